"""``paratrain plan --runtime R --emit FILE``: a plan written as another trainer's own
configuration (the capability tables are in ``plan/runtimes.py``).

- torchtitan: a job TOML read by ``--job.config_file`` (torchtitan 0.2's ``JobConfig``):
  ``[parallelism]`` data_parallel_replicate_degree, data_parallel_shard_degree (FSDP, our
  ZeRO-3, over dp_shard x cp), fsdp_reshard_after_forward, tensor_parallel_degree,
  pipeline_parallel_degree / _schedule / _microbatch_size and the stages' modules,
  context_parallel_degree, expert_parallel_degree; ``[training]`` local_batch_size,
  global_batch_size, seq_len; ``[activation_checkpoint]`` mode.
- Megatron: Megatron-LM's command-line arguments, one per line.
- DeepSpeed: a JSON config: train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x data-parallel size, zero_optimization.stage, bf16,
  pipeline.stages, sequence_parallel_size (Ulysses), tensor_parallel.autotp_size.

Per data-parallel rank, every format holds global_batch / dp = micro_batch x microbatches.
"""

from __future__ import annotations

import json
from pathlib import Path

from .candidate import Candidate, Training
from .models import ModelSpec
from .results import Plan
from .runtimes import Runtime, refusal

TORCHTITAN_FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"),
                      "llama3-405b": ("llama3", "405B")}
"""paratrain presets that are torchtitan model flavors of the same shape."""


def emit_text(runtime: Runtime, plan: Plan, model: ModelSpec, training: Training) -> str:
    """``plan`` as ``runtime``'s configuration file; ValueError (with the reason) where it
    cannot express it."""
    why = refusal(runtime, plan.cand, model, training)
    if why:
        raise ValueError(why)
    writer = {"torchtitan": torchtitan_toml, "megatron": megatron_args,
              "deepspeed": deepspeed_json}[runtime.name]
    return writer(plan, model, training)


def _summary(plan: Plan, model: ModelSpec) -> str:
    return (f"Written by `paratrain plan` for {model.name}: {plan.cand.describe()}; "
            f"predicted {plan.time.step:.3g} s/step (paratrain's speed model)")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # strings and lists of strings: JSON's syntax is TOML's


def _toml(tables: dict[str, dict], comment: str) -> str:
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    for name, values in tables.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def torchtitan_toml(plan: Plan, model: ModelSpec, training: Training) -> str:
    """The plan as a torchtitan job TOML."""
    c = plan.cand
    name, flavor = TORCHTITAN_FLAVORS.get(model.name, ("qwen3", _flavor(model.name)))
    # torchtitan's FSDP mesh is dp_shard x cp, so a shard group of g ranks has g / cp of dp.
    shard = (c.zero_shard // c.cp if c.zero == 3 else 1) if c.shard > 1 else 1
    parallelism = {"data_parallel_replicate_degree": c.dp // shard,
                   "data_parallel_shard_degree": shard,
                   "tensor_parallel_degree": c.tp, "pipeline_parallel_degree": c.pp,
                   "context_parallel_degree": c.cp}
    if c.zero == 3 and c.reshard_after_forward is not None:
        parallelism["fsdp_reshard_after_forward"] = "always" if c.reshards else "never"
    if c.pp > 1:  # one step is one pipelined batch of m microbatches per replica
        parallelism.update(
            pipeline_parallel_schedule={"gpipe": "GPipe", "1f1b": "1F1B"}.get(
                c.schedule, "Interleaved1F1B") if c.virtual_stages == 1 else "Interleaved1F1B",
            pipeline_parallel_microbatch_size=c.micro_batch,
            module_fqns_per_model_part=_torchtitan_stages(model, c))
    if model.n_experts:
        parallelism.update(expert_parallel_degree=c.ep, expert_tensor_parallel_degree=1)
    # Without a pipeline torchtitan accumulates global / (local x dp) microbatches.
    local = c.micro_batch * c.microbatches if c.pp > 1 else c.micro_batch
    tables = {
        "job": {"description": f"paratrain plan: {model.name} {c.describe()}"},
        "model": {"name": name, "flavor": flavor},
        "training": {"local_batch_size": local, "global_batch_size": training.global_batch,
                     "seq_len": training.seq_len,
                     "mixed_precision_param": "bfloat16" if training.precision == "bf16" else "float32"},
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": c.recompute},
    }
    note = "" if model.name in TORCHTITAN_FLAVORS else (
        f"\nRegister flavor {flavor!r} in torchtitan.models.qwen3.qwen3_args first:\n"
        + _qwen3_args(model, training.seq_len))
    return _toml(tables, f"{_summary(plan, model)}\nRun: torchrun ... -m torchtitan.train "
                         f"--job.config_file THIS{note}")


def _flavor(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in Path(name).stem) or "custom"


def _torchtitan_stages(model: ModelSpec, c: Candidate) -> list[list[str]]:
    """The modules of each virtual stage, as paratrain cuts them (torchtitan's module
    names; rank r runs stages r, r + pp, ...)."""
    runs = model.stage_runs(c.pp, c.virtual_stages)
    parts = [[f"layers.{i}" for i in run] for run in runs]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def _qwen3_args(model: ModelSpec, seq_len: int) -> str:
    moe = (f", moe_enabled=True, moe_inter_dim={model.expert_ffn}, moe_args=MoEArgs("
           f"num_experts={model.n_experts}, top_k={model.top_k}, "
           f"num_shared_experts={1 if model.shared_ffn else 0})") if model.n_experts else ""
    return (f"Qwen3ModelArgs(dim={model.d_model}, n_layers={model.n_layers}, "
            f"n_heads={model.n_heads}, n_kv_heads={model.n_kv_heads}, vocab_size={model.vocab_size},\n"
            f"head_dim={model.head_dim}, hidden_dim={model.ffn_hidden}, qk_norm={model.qk_norm}, "
            f"max_seq_len={max(seq_len, model.max_seq_len)}, "
            f"enable_weight_tying={model.tie_embeddings}{moe})")


def megatron_args(plan: Plan, model: ModelSpec, training: Training) -> str:
    """The plan as Megatron-LM's command-line arguments, one per line."""
    flags = _megatron_model(model, training) + _megatron_layout(plan.cand, model, training)
    lines = [f"# {_summary(plan, model)}",
             "# Run: torchrun ... pretrain_gpt.py $(grep -v '^#' THIS) <data and tokenizer args>"]
    return "\n".join(lines + [" ".join(map(str, flag)) for flag in flags]) + "\n"


def _megatron_model(model: ModelSpec, training: Training) -> list[tuple]:
    flags: list[tuple] = [
        ("--num-layers", model.n_layers), ("--hidden-size", model.d_model),
        ("--ffn-hidden-size", model.ffn_hidden), ("--num-attention-heads", model.n_heads),
        ("--seq-length", training.seq_len),
        ("--max-position-embeddings", max(training.seq_len, model.max_seq_len)),
        ("--vocab-size", model.vocab_size),
        ("--position-embedding-type", "learned_absolute" if model.learned_pos else "rope"),
        ("--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"),
        ("--attention-dropout", 0.0), ("--hidden-dropout", 0.0)]
    if model.n_kv_heads != model.n_heads:
        flags += [("--group-query-attention",), ("--num-query-groups", model.n_kv_heads)]
    flags += [(flag,) for flag, on in (
        ("--swiglu", model.gated_mlp), ("--disable-bias-linear", not model.bias),
        ("--add-qkv-bias", model.qkv_bias), ("--qk-layernorm", model.qk_norm),
        ("--untie-embeddings-and-output-weights", not model.tie_embeddings)) if on]
    if model.n_experts:
        freq = [int(model.is_moe(i)) for i in range(model.n_layers)]
        flags += [("--num-experts", model.n_experts), ("--moe-router-topk", model.top_k),
                  ("--moe-ffn-hidden-size", model.expert_ffn),
                  ("--moe-layer-freq", "[" + ",".join(map(str, freq)) + "]"),
                  ("--moe-token-dispatcher-type", "alltoall")]
        if model.shared_ffn:
            flags.append(("--moe-shared-expert-intermediate-size", model.shared_ffn))
            flags += [("--moe-shared-expert-gate",)] if model.shared_gate else []
    if training.precision == "bf16":
        flags.append(("--bf16",))
    return flags


def _megatron_layout(c: Candidate, model: ModelSpec, training: Training) -> list[tuple]:
    flags: list[tuple] = [
        ("--tensor-model-parallel-size", c.tp), ("--pipeline-model-parallel-size", c.pp),
        ("--context-parallel-size", c.cp),
        ("--micro-batch-size", c.micro_batch), ("--global-batch-size", training.global_batch)]
    if c.sp:
        flags.append(("--sequence-parallel",))
    if c.cp > 1:
        flags.append(("--cp-comm-type", "a2a" if c.cp_method == "ulysses" else "p2p"))
    if model.n_experts:  # paratrain keeps whole experts on every tp rank
        flags += [("--expert-model-parallel-size", c.ep), ("--expert-tensor-parallel-size", 1)]
    runs = [len(r) for r in model.stage_runs(c.pp, c.virtual_stages)] if c.pp > 1 else []
    if c.virtual_stages > 1:
        flags.append(("--num-layers-per-virtual-pipeline-stage", runs[0]))
    elif c.pp > 1 and len(set(runs)) > 1:
        flags += [("--decoder-first-pipeline-num-layers", runs[0]),
                  ("--decoder-last-pipeline-num-layers", runs[-1])]
    if c.shard > 1:  # the planner overlaps the gradient reduction with backward
        flags.append(("--overlap-grad-reduce",))
        if c.zero == 1:
            flags += [("--use-distributed-optimizer",), ("--overlap-param-gather",)]
    if c.recompute == "selective":
        flags.append(("--recompute-granularity", "selective"))
    elif c.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                  ("--recompute-num-layers", 1)]
    return flags


def deepspeed_json(plan: Plan, model: ModelSpec, training: Training) -> str:
    """The plan as a DeepSpeed JSON config (JSON has no comments: the plan is in
    ``paratrain_plan``, a key DeepSpeed ignores)."""
    c = plan.cand
    config: dict = {
        "train_batch_size": training.global_batch,
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.microbatches,
        "zero_optimization": {"stage": c.zero},
        "bf16": {"enabled": training.precision == "bf16"},
    }
    if c.pp > 1:  # the stages are the PipelineModule's; the config names and checks them
        config["pipeline"] = {"stages": c.pp, "partition": "uniform",
                              "activation_checkpoint_interval": 1 if c.recompute == "full" else 0}
    elif c.recompute == "full":
        config["activation_checkpointing"] = {"partition_activations": False,
                                              "contiguous_memory_optimization": False}
    if c.cp > 1:
        config["sequence_parallel_size"] = c.cp
    if c.tp > 1:
        config["tensor_parallel"] = {"autotp_size": c.tp}
    config["paratrain_plan"] = _summary(plan, model)
    return json.dumps(config, indent=2) + "\n"


def write(path: str | Path, runtime: Runtime, plan: Plan, model: ModelSpec,
          training: Training) -> None:
    """Write ``plan`` as ``runtime``'s configuration to ``path`` (nothing on ValueError)."""
    text = emit_text(runtime, plan, model, training)
    Path(path).write_text(text.replace("THIS", str(path)))


def runnable(runtime: Runtime, result, model: ModelSpec, training: Training, cluster,
             micro: int | None, recompute: str | None, like: Candidate | None = None) -> Plan | None:
    """The nearest plan ``runtime`` expresses (``runtimes.nearest``): from the ranking, else
    from a search of only what it can run (its ZeRO stages, cp methods, SP, HSDP)."""
    from .runtimes import nearest
    from .search import search

    found = nearest(runtime, result, model, training, like)
    if found is None:
        narrow = search(model, training, cluster, micro_batch=micro, recompute=recompute,
                        zero=runtime.zero, context_parallel=bool(runtime.cp_methods),
                        sequence_parallel="sp" in runtime.tp_modes, hsdp=runtime.hsdp,
                        uneven_stages=runtime.uneven_stages,
                        ulysses="ulysses" in runtime.cp_methods)
        found = nearest(runtime, narrow, model, training, like)
    return found


def spec(cand: Candidate, model: ModelSpec) -> str:
    """``cand`` as a ``--layout`` spec that completes to itself: ``describe`` leaves ep1
    out, which a mixture of experts' spec would search again."""
    return cand.describe() + (" ep1" if model.n_experts and cand.ep == 1 else "")


def emit_best(path: str, runtime: Runtime, result, model: ModelSpec, training: Training,
              cluster, micro: int | None, recompute: str | None, log) -> str | None:
    """``--emit`` without ``--layout``: the winner in ``runtime``'s format or, where it
    cannot express the winner, the best-ranked plan it can (saying why); the error, or None."""
    best = result.plans[0]
    why = refusal(runtime, best.cand, model, training)
    chosen = best if not why else runnable(runtime, result, model, training, cluster, micro,
                                           recompute)
    if chosen is None:
        return f"{why}; and no plan that fits is one it can express"
    write(path, runtime, chosen, model, training)
    if why:
        slower = chosen.time.step / best.time.step - 1
        print(f"--emit: the winner is refused: {why}\n--emit: wrote the best plan "
              f"{runtime.name} can run instead: {chosen.cand.describe()} "
              f"({slower:+.1%} step time)", file=log)
    print(f"wrote {path}: {runtime.title} config of {chosen.cand.describe()}", file=log)
    return None


def emit_layout(path: str, runtime: Runtime, plan: Plan, result, model: ModelSpec,
                training: Training, cluster, micro: int | None, recompute: str | None,
                log) -> str | None:
    """``--layout SPEC --emit FILE``: that layout in ``runtime``'s format; where it cannot
    express it, the error with the nearest plan it can (nothing written)."""
    why = refusal(runtime, plan.cand, model, training)
    if not why:
        write(path, runtime, plan, model, training)
        print(f"wrote {path}: {runtime.title} config of {plan.cand.describe()}", file=log)
        return None
    near = runnable(runtime, result, model, training, cluster, micro, recompute, plan.cand)
    offer = (f"; the nearest plan {runtime.name} can run: --layout '{spec(near.cand, model)}' "
             f"({near.time.step:.3g} s/step)" if near else
             f"; no plan that fits is one {runtime.name} can run")
    return f"{why}{offer}; {path} not written"


def emit_plan(path: str, runtime: Runtime, result, model: ModelSpec, training: Training,
              cluster, micro: int | None, recompute: str | None, log, ev=None) -> str | None:
    """``--emit`` for another trainer: the winner, or with ``--layout`` the evaluated
    layout ``ev``; the error (nothing written), or None."""
    if ev is None:
        return emit_best(path, runtime, result, model, training, cluster, micro, recompute, log)
    if not ev.fits:
        return (f"{ev.cand.describe()} is rejected ({'; '.join(ev.problems)}); change the "
                f"layout or drop --layout to write the winner")
    plan = Plan(ev.cand, ev.memory, ev.time, ev.tokens_per_s, ev.mfu)
    return emit_layout(path, runtime, plan, result, model, training, cluster, micro,
                       recompute, log)
