"""``paratrain plan --runtime R --emit FILE``: each emitted config is read by its
framework's own parser (torchtitan's ConfigManager and ParallelDims, megatron-core's
TransformerConfig, DDP config and microbatch calculator, DeepSpeed's DeepSpeedConfig),
and what a framework cannot express is refused with the nearest plan it can run."""

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import sys
import types

import pytest
import torch

from paratrain.plan import cli

MODEL = ("--model", "llama3-8b", "--gpus", "16", "--global-batch", "64", "--seq-len", "4096")
MOE = "[model]\npreset = \"tiny\"\nn_experts = 4\ntop_k = 2\nexpert_ffn = 48\n"


def plan(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="paratrain")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


# --- the frameworks' parsers -------------------------------------------------------------

def torchtitan_modules():
    """torchtitan's config package and ParallelDims. Its 0.2 package ``__init__``
    registers quantization converters whose MoE kernels import triton (a GPU compiler,
    not installed on CPU machines); where triton is missing the package's submodules are
    imported without that ``__init__``, unchanged."""
    if importlib.util.find_spec("triton") is None and "torchtitan.config" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        package = types.ModuleType("torchtitan")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = package
    config = importlib.import_module("torchtitan.config")
    dims = importlib.import_module("torchtitan.distributed.parallel_dims")
    return config, dims


def load_torchtitan(path, world: int):
    """The JobConfig torchtitan's ConfigManager reads from ``path`` (as ``torchtitan.train
    --job.config_file``), and the ParallelDims it builds, which checks the degrees
    multiply to the world size."""
    config, dims = torchtitan_modules()
    job = config.ConfigManager().parse_args(["--job.config_file", str(path)])
    p = job.parallelism
    parallel = dims.ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                 p.context_parallel_degree, p.tensor_parallel_degree,
                                 p.pipeline_parallel_degree, p.expert_parallel_degree,
                                 p.expert_tensor_parallel_degree, world)
    return job, parallel


MEGATRON_BY_HAND = {"--seq-length", "--max-position-embeddings", "--vocab-size",
                    "--position-embedding-type", "--untie-embeddings-and-output-weights",
                    "--micro-batch-size", "--global-batch-size", "--use-distributed-optimizer",
                    "--overlap-grad-reduce", "--overlap-param-gather", "--swiglu",
                    "--group-query-attention", "--num-experts",
                    "--num-layers-per-virtual-pipeline-stage",
                    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"}
"""Megatron-LM flags that are not TransformerConfig fields: its arguments.py maps them by
hand (core_transformer_config_from_args), as ``load_megatron`` does."""


def _value(text: str):
    for parse in (int, float, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            pass
    return text


def read_flags(path) -> dict[str, object]:
    """Megatron-LM's arguments from the file: ``--flag value`` or ``--flag`` (True)."""
    tokens = [t for line in path.read_text().splitlines() if not line.startswith("#")
              for t in line.split()]
    flags, i = {}, 0
    while i < len(tokens):
        assert tokens[i].startswith("--"), tokens[i]
        has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        flags[tokens[i]] = _value(tokens[i + 1]) if has_value else True
        i += 2 if has_value else 1
    return flags


def load_megatron(path, world: int):
    """megatron-core's TransformerConfig (with its ModelParallelConfig checks), DDP config
    and microbatch calculator built from the emitted arguments. Megatron-LM's argparse is
    not in the megatron-core package; it names each TransformerConfig flag after its
    field (``--tensor-model-parallel-size``, or the field's ``argparse_meta`` names), so
    every other flag must be one it maps by hand."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer.transformer_config import TransformerConfig

    flags = read_flags(path)
    by_flag = {}
    for f in dataclasses.fields(TransformerConfig):
        names = f.metadata.get("argparse_meta", {}).get("arg_names") or [
            "--" + f.name.replace("_", "-")]
        by_flag.update({name: f for name in names})
    unknown = set(flags) - set(by_flag) - MEGATRON_BY_HAND
    assert not unknown, f"flags Megatron-LM does not have: {unknown}"
    kwargs = {}
    for flag, value in flags.items():
        if flag in by_flag:
            f = by_flag[flag]  # a bool flag stores the opposite of its default
            kwargs[f.name] = (not f.default) if value is True and isinstance(f.default, bool) else value
    dtype = torch.bfloat16 if flags.get("--bf16") else torch.float32
    kwargs.update(params_dtype=dtype, pipeline_dtype=dtype)
    if flags.get("--swiglu"):
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if "--num-experts" in flags:
        kwargs["num_moe_experts"] = flags["--num-experts"]
    pp = flags["--pipeline-model-parallel-size"]
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        kwargs["virtual_pipeline_model_parallel_size"] = (
            flags["--num-layers"] // pp // flags["--num-layers-per-virtual-pipeline-stage"])
    for end in ("first", "last"):
        if f"--decoder-{end}-pipeline-num-layers" in flags:
            kwargs[f"num_layers_in_{end}_pipeline_stage"] = flags[f"--decoder-{end}-pipeline-num-layers"]
    config = TransformerConfig(**kwargs)
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer="--use-distributed-optimizer" in flags,
        overlap_grad_reduce="--overlap-grad-reduce" in flags,
        overlap_param_gather="--overlap-param-gather" in flags)
    dp = world // (config.tensor_model_parallel_size * pp * config.context_parallel_size)
    batches = ConstantNumMicroBatchesCalculator(flags["--global-batch-size"],
                                                flags["--micro-batch-size"], dp, False, 0)
    return config, ddp, batches, dp


class _Mpu:
    """The model-parallel unit DeepSpeed asks for its data-parallel size, as
    Megatron-DeepSpeed passes one to ``deepspeed.initialize``."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def deepspeed_config(monkeypatch):
    """``load(path, dp)``: DeepSpeedConfig of the file as rank 0 of a job with ``dp``
    data-parallel ranks. DeepSpeed reads the data-parallel size only from an initialised
    backend, so one single-process gloo group stands in for the job; its CPU backend
    would first JIT-compile a shared-memory all-reduce kernel (70 s on 2 cores) that
    reading a config never uses."""
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig

    ds_comm = importlib.import_module("deepspeed.comm.comm")
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the package's `torch` is torch

    monkeypatch.setattr(ds_torch, "build_shm_op", lambda: None)
    monkeypatch.setattr(ds_comm, "cdb", None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        yield lambda path, dp: DeepSpeedConfig(str(path), mpu=_Mpu(dp))
    finally:
        dist.destroy_process_group()


# --- round trips -------------------------------------------------------------------------

def emit(tmp_path, runtime: str, layout: str | None, name: str, model=MODEL):
    path = tmp_path / name
    args = [*model, "--runtime", runtime, "--emit", str(path)]
    assert plan(*args, *(["--layout", layout] if layout else [])) == 0
    return path


def test_torchtitan_job_toml_round_trips(tmp_path, capsys):
    path = emit(tmp_path, "torchtitan", "dp2 tp2 pp2 cp2 z3 interleaved/v2 mb1 rc=full", "a.toml")
    job, dims = load_torchtitan(path, 16)
    p, t = job.parallelism, job.training
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp) == (1, 2, 2, 2, 2)
    assert p.pipeline_parallel_schedule == "Interleaved1F1B"
    assert len(p.module_fqns_per_model_part) == 2 * 2  # pp x v stages, every layer once
    layers = [m for part in p.module_fqns_per_model_part for m in part if m.startswith("layers.")]
    assert layers == [f"layers.{i}" for i in range(32)]
    # pipelined: each replica's local batch is m microbatches of the microbatch size
    assert t.local_batch_size // p.pipeline_parallel_microbatch_size == 32
    assert t.local_batch_size * (dims.dp_replicate * dims.dp_shard) == t.global_batch_size == 64
    assert (t.seq_len, job.activation_checkpoint.mode, job.model.flavor) == (4096, "full", "8B")
    assert "runtime: torchtitan" in capsys.readouterr().out


def test_torchtitan_winner_with_hybrid_sharding_and_accumulation(tmp_path, capsys):
    path = emit(tmp_path, "torchtitan", "dp16 z3/hsdp8 mb1", "b.toml")
    job, dims = load_torchtitan(path, 16)
    t = job.training
    assert (dims.dp_replicate, dims.dp_shard) == (2, 8)
    # no pipeline: torchtitan accumulates global / (local x dp) microbatches
    assert t.global_batch_size // (t.local_batch_size * dims.dp_replicate * dims.dp_shard) == 4


def test_megatron_arguments_round_trip(tmp_path):
    path = emit(tmp_path, "megatron", "dp2 tp2 pp2 cp2 z1 interleaved/v2 mb1 rc=selective",
                "a.args")
    config, ddp, batches, dp = load_megatron(path, 16)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
            config.context_parallel_size, config.virtual_pipeline_model_parallel_size) == (2, 2, 2, 2)
    assert config.sequence_parallel and config.recompute_granularity == "selective"
    assert (config.num_layers, config.hidden_size, config.num_query_groups) == (32, 4096, 8)
    assert ddp.use_distributed_optimizer and dp == 2
    assert batches.get() == 32 and batches.get_current_global_batch_size() == 64


def test_megatron_uneven_first_and_last_stages(tmp_path):
    model = ("--model", "llama3-8b", "--gpus", "12", "--gpus-per-node", "4",
             "--global-batch", "48", "--seq-len", "4096")
    path = emit(tmp_path, "megatron", "dp2 tp2 pp3 z1 1f1b mb1 rc=full", "b.args", model)
    config, _, batches, dp = load_megatron(path, 12)  # 32 layers on 3 stages
    assert config.pipeline_model_parallel_size == 3 and config.recompute_granularity == "full"
    ends = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    assert ends == (10, 10) and dp == 2  # paratrain's 10-12-10: the ends hold the embedding and head
    assert batches.get() * dp * read_flags(path)["--micro-batch-size"] == 48


def test_deepspeed_json_round_trips(tmp_path, deepspeed_config):
    path = emit(tmp_path, "deepspeed", "dp4 pp4 z1 1f1b mb2", "a.json")
    ds = deepspeed_config(path, 4)
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (2, 8)
    assert ds.train_batch_size == 2 * 8 * 4 == 64
    assert ds.zero_optimization_stage == 1 and ds.pipeline["stages"] == 4 and ds.bfloat16_config.enabled
    path = emit(tmp_path, "deepspeed", "dp4 cp4/ulysses z2 mb1", "b.json")
    ds = deepspeed_config(path, 4)
    assert ds.zero_optimization_stage == 2 and json.loads(path.read_text())["sequence_parallel_size"] == 4
    assert ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * 4 == ds.train_batch_size


def test_deepspeed_writes_the_winner(tmp_path, deepspeed_config):
    path = emit(tmp_path, "deepspeed", None, "w.json")
    config = json.loads(path.read_text())
    dp = 16 // config.get("sequence_parallel_size", 1) // config.get("pipeline", {}).get("stages", 1)
    ds = deepspeed_config(path, dp)
    assert ds.train_batch_size == 64


# --- refusals ------------------------------------------------------------------------------

def refused(tmp_path, capsys, runtime: str, layout: str, model=MODEL) -> tuple[str, str]:
    """The error for ``layout`` (nothing written) and the nearest plan it offers, which
    it then writes."""
    path = tmp_path / "refused"
    assert plan(*model, "--runtime", runtime, "--emit", str(path), "--layout", layout) == 2
    assert not path.exists()
    err = capsys.readouterr().err
    offered = err.split("--layout '")[1].split("'")[0]
    assert plan(*model, "--runtime", runtime, "--emit", str(path), "--layout", offered) == 0
    assert path.exists()
    return err, offered


@pytest.mark.parametrize("runtime, layout, reason", [
    ("torchtitan", "dp4 cp4/ulysses z3 mb1", "ulysses context parallelism is not among its methods"),
    ("torchtitan", "dp16 z1 mb1", "ZeRO-1 is not one of its stages"),
    ("torchtitan", "dp4 tp2 pp2 z3 1f1b mb1 rc=selective", "selective recompute"),
    ("megatron", "dp8 tp2 pp1 cp1 z3 mb1", "ZeRO-3 is not one of its stages"),
    ("megatron", "dp4 pp4 gpipe z1 mb1", "the gpipe pipeline schedule is not one of its"),
    ("deepspeed", "dp4 pp4 interleaved/v2 z1 mb1", "the interleaved pipeline schedule is not one of its"),
    ("deepspeed", "dp4 pp4 z2 1f1b mb1", "ZeRO-2 is refused under pipeline parallelism"),
    ("deepspeed", "dp4 tp2-sp pp2 z1 1f1b mb1", "tensor parallelism together with a pipeline"),
    ("deepspeed", "dp8 tp2+sp z1 mb1", "tensor parallelism with sequence parallelism"),
])
def test_what_a_framework_cannot_express_is_refused(tmp_path, capsys, runtime, layout, reason):
    err, offered = refused(tmp_path, capsys, runtime, layout)
    assert reason in err and f"the nearest plan {runtime} can run" in err


def test_the_search_proposes_only_what_the_framework_runs(tmp_path, capsys):
    args = ("--model", "llama3-8b", "--gpus", "16", "--global-batch", "512")
    assert plan(*args, "--top", "1") == 0  # paratrain's own winner shards with ZeRO-2
    assert "zero2" in capsys.readouterr().out
    path = emit(tmp_path, "torchtitan", None, "w.toml", args)
    out = capsys.readouterr().out  # torchtitan's search has FSDP (ZeRO-3) and DDP only
    assert "the winner is refused" not in out and "zero2" not in out
    job, dims = load_torchtitan(path, 16)
    assert job.training.global_batch_size == 512


# --- a mixture of experts --------------------------------------------------------------------

MOE_ARGS = ("--gpus", "8", "--global-batch", "16", "--seq-len", "64")


def moe_plan(tmp_path, runtime: str, layout: str, name: str) -> int:
    model = tmp_path / "moe.toml"
    model.write_text(MOE)
    return plan("--model", str(model), *MOE_ARGS, "--runtime", runtime,
                "--emit", str(tmp_path / name), "--layout", layout)


def test_moe_emitted_with_expert_parallelism(tmp_path, capsys):
    assert moe_plan(tmp_path, "torchtitan", "dp8 ep2 z3 mb1", "moe.toml.out") == 0
    job, dims = load_torchtitan(tmp_path / "moe.toml.out", 8)
    assert (dims.ep, dims.etp, dims.dp_shard) == (2, 1, 8)
    assert moe_plan(tmp_path, "megatron", "dp4 tp2 ep2 z1 mb1", "moe.args") == 0
    config, _, batches, dp = load_megatron(tmp_path / "moe.args", 8)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 48)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert batches.get() * dp * 1 == 16


def test_deepspeed_refuses_expert_parallelism(tmp_path, capsys):
    model = tmp_path / "moe.toml"
    model.write_text(MOE)
    err, offered = refused(tmp_path, capsys, "deepspeed", "dp8 ep2 z1 mb1",
                           ("--model", str(model), *MOE_ARGS))
    assert "expert parallelism is not set in its config" in err and "ep2" not in offered
