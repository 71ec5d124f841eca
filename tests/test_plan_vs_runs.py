"""The planner against paratrain's own runs: per-rank state bytes exactly, and the bytes
paratrain's block saves for backward exactly (measured with saved-tensor hooks)."""

from __future__ import annotations

import json

import pytest
import torch

from distributed import run_world
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, PRESETS
from paratrain.parallel.recompute import apply_recompute
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.cost import step_time
from paratrain.plan.flops import attention_core_flops, step_flops
from paratrain.plan.hardware import Calibration, load_calibration, local_cluster
from paratrain.plan.memory import paratrain_state_bytes, rank_memory
from paratrain.plan.models import from_gpt_config, load_model
from paratrain.plan.runtime import paratrain_layer_activation_bytes, precision_mode
from paratrain.train.config import load
from paratrain.train.loop import train

# (preset, zero, precision) per world size: every ZeRO stage in fp32, bf16 both ways
# (autocast under plain DP, bf16 weights under ZeRO), padding that differs per stage.
LAYOUTS = {
    1: [("tiny", 0, "fp32"), ("small", 0, "bf16"), ("tiny", 2, "bf16")],
    2: [("tiny", 0, "fp32"), ("tiny", 1, "fp32"), ("tiny", 2, "fp32"), ("tiny", 3, "fp32"),
        ("tiny", 2, "bf16"), ("tiny", 0, "bf16"), ("small", 1, "fp32"), ("small", 3, "bf16")],
    4: [("tiny", 3, "fp32"), ("tiny", 1, "bf16"), ("tiny", 2, "fp32"), ("small", 0, "fp32")],
}


def run_config(tmp_dir: str, nproc: int, preset: str, zero: int, precision: str):
    return load(None, {"preset": preset, "dp": nproc, "zero": zero, "precision": precision,
                       "seq_len": 32, "global_batch": 4, "steps": 1, "eval_every": 0,
                       "eval_batches": 1, "progress": False, "run_dir": tmp_dir}).validate()


def _cand(cfg) -> Candidate:
    """The planner's description of a training config's layout."""
    p = cfg.parallel
    return Candidate(cfg.layout, p.zero, cfg.micro_batch, cfg.accumulation,
                     virtual_stages=p.virtual_stages)


def measured_state_bytes(configs) -> list[list[dict[str, int]]]:
    """Train each config one step; every rank's parameter, gradient and optimizer bytes."""
    return [train(cfg, Mesh.build(cfg.layout)).state_bytes for cfg in configs]


@pytest.mark.parametrize("nproc", sorted(LAYOUTS))
def test_state_bytes_equal_the_planners(nproc, tmp_path):
    configs = [run_config(str(tmp_path), nproc, *layout) for layout in LAYOUTS[nproc]]
    measured = run_world(measured_state_bytes, nproc, configs)[0]
    for cfg, (preset, zero, precision), per_rank in zip(configs, LAYOUTS[nproc], measured):
        spec = from_gpt_config(cfg.model, preset)
        predicted = paratrain_state_bytes(spec, _cand(cfg), precision)
        assert len(per_rank) == nproc
        for rank, got in enumerate(per_rank):
            assert got == predicted, (preset, f"dp{nproc} zero{zero} {precision} rank {rank}")
        # The planner's memory model for the local cluster uses the same numbers.
        cand = Candidate(Layout(dp=nproc), zero, micro_batch=4 // nproc, microbatches=1)
        mem = rank_memory(spec, Training(4, 32, precision), cand, paratrain=True)
        assert (mem.params, mem.grads, mem.optimizer) == tuple(predicted.values())


# Model-parallel layouts on 4 ranks: tp shards (a vocabulary of 250 padded to 252, KV heads
# replicated at tp=4), pipeline stages holding different units, cp replicating weights.
MODEL_PARALLEL = [dict(dp=2, tp=2, zero=1), dict(tp=4, vocab_size=250),
                  dict(dp=2, pp=2, zero=1, n_layers=4), dict(tp=2, pp=2, n_layers=4, vocab_size=250),
                  dict(dp=2, cp=2, zero=3), dict(tp=2, cp=2, zero=2, precision="bf16"),
                  dict(dp=2, pp=2, zero=3, n_layers=4), dict(dp=2, pp=2, zero=2, n_layers=4, precision="bf16"),
                  # mixtures of experts: each rank holds n_experts / ep experts of each MoE
                  # block, and the selection bias without gradient or optimizer state
                  dict(dp=4, n_experts=4, top_k=2, expert_ffn=48),
                  dict(dp=4, ep=2, n_experts=4, top_k=2, expert_ffn=48, moe_first_dense=1),
                  dict(dp=4, ep=4, n_experts=4, top_k=1, expert_ffn=48, shared_ffn=32,
                       shared_gate=True, precision="bf16"),
                  # under ZeRO each block's experts are a unit over the dp / ep ranks holding them
                  dict(dp=4, ep=2, zero=1, n_experts=4, top_k=2, expert_ffn=48),
                  dict(dp=4, ep=2, zero=3, n_experts=4, top_k=2, expert_ffn=40, precision="bf16"),
                  # tp splits attention only: router, experts and shared expert whole on each rank
                  dict(dp=2, tp=2, sp=True, ep=2, n_experts=4, top_k=2, expert_ffn=48, shared_ffn=32,
                       shared_gate=True),
                  dict(tp=2, cp=2, ep=2, zero=1, n_experts=4, top_k=2, expert_ffn=48, shared_ffn=32,
                       moe_first_dense=1),
                  # HSDP: dense units sharded over the shard group, experts over their edp group
                  dict(dp=4, zero=3, shard_group=2),
                  dict(dp=4, ep=2, zero=3, shard_group=2, n_experts=4, top_k=2, expert_ffn=48)]


def test_model_parallel_state_bytes_equal_the_planners(tmp_path):
    base = {"preset": "tiny", "nproc": 4, "seq_len": 32, "global_batch": 4, "steps": 1,
            "eval_every": 0, "eval_batches": 1, "progress": False, "run_dir": str(tmp_path)}
    configs = [load(None, {**base, **layout}).validate() for layout in MODEL_PARALLEL]
    measured = run_world(measured_state_bytes, 4, configs)[0]
    for cfg, layout, per_rank in zip(configs, MODEL_PARALLEL, measured):
        spec = from_gpt_config(cfg.model, "tiny")
        for rank, got in enumerate(per_rank):
            stage = cfg.layout.coords(rank)["pp"]
            predicted = paratrain_state_bytes(spec, _cand(cfg), cfg.train.precision, stage=stage)
            assert got == predicted, (layout, f"rank {rank}")


# ---- activations saved for backward by one block ----------------------------------------

def saved_bytes(preset: str, mode: str, recompute: str, b: int, s: int) -> tuple[int, int]:
    """(activation bytes, bf16 weight-copy bytes) one block of ``preset`` saves for
    backward, deduplicated by storage. Parameters and the RoPE tables (shared by all
    blocks) are not the block's; autocast's bf16 copies of the weights are counted apart."""
    torch.manual_seed(0)
    cfg = PRESETS[preset]
    model = GPT(cfg)
    apply_recompute(model.layers, recompute)
    block = model.layers[0]
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    for p in block.parameters():  # ZeRO's bf16 weights; the RoPE tables stay fp32
        p.data = p.data.to(dtype)
    cos, sin = model.rope(torch.arange(s))
    x = torch.randn(b, s, cfg.d_model, dtype=dtype, requires_grad=True)
    not_activations = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin)}
    weight_shapes = {tuple(p.shape) for p in block.parameters() if p.ndim == 2}
    weight_shapes |= {shape[::-1] for shape in weight_shapes}
    activations, weight_copies = {}, {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in not_activations:
            copy = t.dim() == 2 and tuple(t.shape) in weight_shapes
            (weight_copies if copy else activations)[storage.data_ptr()] = storage.nbytes()
        return t

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")):
        block(x, cos, sin).float().sum().backward()
    return sum(activations.values()), sum(weight_copies.values())


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16"])
def test_block_activation_bytes_exact(preset, mode):
    b, s = 3, 40  # b*s matches no weight dimension, so weight copies are told apart
    spec = from_gpt_config(PRESETS[preset], preset)
    for recompute in ("none", "selective", "full"):
        measured, copies = saved_bytes(preset, mode, recompute, b, s)
        predicted = paratrain_layer_activation_bytes(spec, s, b, recompute=recompute, mode=mode)
        assert predicted == measured, (recompute, predicted, measured)  # exact at t = 1
        if mode == "autocast" and recompute != "full":  # bf16 copies of all 7 matrices
            h, kv, f = spec.d_model, spec.n_kv_heads * spec.head_dim, spec.ffn_hidden
            assert copies == 2 * (2 * h * h + 2 * h * kv + 3 * h * f)


def test_precision_modes_follow_the_engines():
    assert precision_mode("fp32", 3) == "fp32"
    assert precision_mode("bf16", 0) == "autocast"  # DDP: autocast over fp32 weights
    assert precision_mode("bf16", 1) == "bf16"  # ZeRO: bf16 weights, fp32 masters


# ---- calibration and the local cluster --------------------------------------------------

def test_calibration_pieces_measure_something():
    from paratrain.plan import calibrate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as calibrate() measures, like a training rank
    try:
        rate, half_dim = calibrate.matmul_curve("fp32")
        efficiency, overhead = calibrate.eager_costs("fp32", rate, half_dim)
        assert rate > 1e8 and half_dim >= 0 and 0 < efficiency <= 1 and overhead >= 0
        assert calibrate.adamw_rate(numel=1 << 16) > 1e5
        assert 0 < calibrate.reference_step_time(b=1, runs=1) < 60
        rates = dict(matmul_flops={"fp32": rate}, matmul_half_dim={"fp32": half_dim},
                     compute_efficiency={"fp32": efficiency}, layer_overhead=overhead)
        per_expert, per_row = calibrate.moe_costs(rates, runs=2)
        assert per_expert >= 0 and per_row >= 0
    finally:
        torch.set_num_threads(threads)
    from paratrain.plan import calibrate_comm

    fits = calibrate_comm.collective_alpha_beta(2, iters=2)
    assert set(fits) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"}
    assert all(alpha >= 0 and beta > 0 for alpha, beta in fits.values())



def test_model_steps_are_timed_by_their_median(monkeypatch):
    # A run reports the median of its steps; the calibration times its model steps the
    # same way, not by the fastest (a fake clock: each call takes the next duration).
    from paratrain.plan import calibrate

    now = [0.0]
    durations = iter([9.0, 0.3, 0.1, 0.2, 0.5, 0.4])  # warm-up first, then five steps
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])

    def call():
        now[0] += next(durations)

    assert calibrate._median_time(call, 5) == pytest.approx(0.3)

FAKE = Calibration(
    matmul_flops={"fp32": 40e9, "bf16": 100e9}, cores=2, alpha=100e-6, beta=1e9,
    memory=8 * 2**30, comm={"2": {"all-reduce": [100e-6, 1e9], "all-gather": [50e-6, 0.5e9],
                                  "reduce-scatter": [50e-6, 0.25e9]},
                            "4": {"all-reduce": [1e-3, 0.5e9]}},
    optimizer_rate=300e6, compute_efficiency={"fp32": 0.5, "bf16": 0.25}, layer_overhead=1e-3)


def test_calibrate_flag_writes_what_local_plans_read(tmp_path, monkeypatch, capsys):
    from helpers import plan

    from paratrain.plan import calibrate

    monkeypatch.setattr(calibrate, "calibrate", lambda log: FAKE)
    path = tmp_path / "cal.json"
    assert plan("--cluster", "local", "--calibrate", "--calibration", str(path)) == 0
    assert load_calibration(path) == FAKE and str(path) in capsys.readouterr().out
    assert plan("--cluster", "local", "--model", "small", "--gpus", "2", "--calibration",
                str(path), "--micro-batch", "4", "--recompute", "none", "--json") == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    zero = best["layout"]["zero"]
    states = paratrain_state_bytes(load_model("small"), Candidate(Layout(dp=2), zero, 4, 1),
                                   "fp32")
    assert [best["memory_bytes"][k] for k in ("params", "grads", "optimizer")] == \
        list(states.values())
    assert plan("--cluster", "local") == 2  # a plan needs a model
    assert "--model is required" in capsys.readouterr().err
    old_format = json.loads(FAKE.to_json()) | {"comm": {"2": [1e-4, 1e9]}}
    path.write_text(json.dumps(old_format))
    assert plan("--cluster", "local", "--model", "small", "--calibration", str(path)) == 2
    assert "re-run `paratrain plan --cluster local --calibrate`" in capsys.readouterr().err


def test_local_cluster_uses_the_measured_rates():
    two, four = local_cluster(2, FAKE), local_cluster(4, FAKE)
    assert two.gpu.peak_flops_fp32 == 40e9 and four.gpu.peak_flops_fp32 == 20e9  # 2 cores
    assert two.gpu.efficiency_fp32 == 0.5 and two.gpu.efficiency == 0.25
    assert {op: (a, b) for op, a, b in two.gpu.collectives}["reduce-scatter"] == \
        (50e-6, 0.25e9)
    assert four.gpu.nvlink_alpha == 1e-3 and two.gpu.overlap_cost == 1.0  # every core busy
    model, training = load_model("small"), Training(8, 128, "fp32")
    ddp, zero1 = (step_time(model, training, two, Candidate(Layout(dp=2), z, 4, 1))
                  for z in (0, 1))
    psi = model.num_params() * 4
    # Hidden behind backward with every core busy, a ring all-reduce at p = 2 still costs
    # all of its time, its 2 alpha of latency included (measured: docs/plan.md).
    assert ddp.dp == pytest.approx(2 * 100e-6 + psi / 1e9)
    # ZeRO on gloo reduces by all-reduce (keeping its slice), as zero/engine.py does; the
    # updated parameters come back by all-gather.
    assert zero1.dp == pytest.approx(2 * 100e-6 + psi / 1e9 + 50e-6 + psi / 2 / 0.5e9)
    assert ddp.optimizer == pytest.approx(model.num_params() / 300e6)
    flops = step_flops(model, Training(4, 128, "fp32"))  # one microbatch of one rank
    # The causal attention core runs half the FLOPs Megatron's count includes.
    causal = 3 * model.n_layers * attention_core_flops(model, 4, 128, 128, 1) / 2
    assert ddp.compute == pytest.approx((flops - causal) / 20e9 + 6 * 1e-3)  # 6 blocks' dispatch
    assert four.gpu.layer_overhead == 2e-3  # processes time-share the 2 cores
    # bf16 data parallelism is autocast: its gradients, and all-reduce, stay fp32.
    bf16 = Training(8, 128, "bf16")
    assert step_time(model, bf16, two, Candidate(Layout(dp=2), 0, 4, 1)).dp == ddp.dp


def tp_block_saved_bytes(sp: bool, b: int, s: int) -> int:
    """Bytes block 0 of a tp=2 tiny GPT saves for backward on this rank (fp32)."""
    from paratrain.layout import Layout
    from paratrain.parallel.tensor import apply_tensor_parallel

    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    mesh = Mesh.build(Layout(tp=2))
    apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sp)
    block = model.layers[0]
    cos, sin = model.rope(torch.arange(s))
    x = torch.randn(b, s // 2 if sp else s, model.cfg.d_model, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin).sum().backward()
    return sum(saved.values())


def test_a_moe_block_pays_its_measured_eager_costs_on_the_local_cluster():
    """calibrate.moe_costs's per-expert and per-row seconds enter each MoE block: per local
    expert (n_experts / ep) and per routed row (tokens x top_k), a third forward, and, as
    every local cost, twice over where four processes share two cores. GPUs pay none."""
    import dataclasses

    from paratrain.plan import moe

    model = from_gpt_config(dataclasses.replace(PRESETS["small"], n_experts=4, top_k=2,
                                                expert_ffn=256), "small")
    training, b = Training(8, 128, "fp32"), 4
    rows = b * 128 * 2
    costly = dataclasses.replace(FAKE, moe_expert_overhead=2e-4, moe_row_cost=2e-6)

    def extra(calibration, n, ep):
        fwd, bwd = moe.block_time(model, training, local_cluster(n, calibration), 1, 1, b,
                                  False, ep)
        base = moe.block_time(model, training, local_cluster(n, FAKE), 1, 1, b, False, ep)
        return fwd - base[0], bwd - base[1]

    for n, ep, share in ((2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 4, 2)):
        per_block = share * (2e-4 * (4 // ep) + 2e-6 * rows)
        assert extra(costly, n, ep) == pytest.approx((per_block / 3, 2 * per_block / 3))
    from paratrain.plan.hardware import gpu_preset
    assert gpu_preset("h100-80g").moe_expert_overhead == 0 == gpu_preset("h100-80g").moe_row_cost


def test_moe_costs_are_what_the_planner_leaves_out(monkeypatch):
    """calibrate.moe_costs recovers the per-expert and per-row seconds a fake clock adds to
    the MoE model's step beyond the planner's own count (a fake step reports its time)."""
    import dataclasses

    from paratrain.plan import calibrate

    rates = dict(matmul_flops={"fp32": 40e9}, compute_efficiency={"fp32": 0.5},
                 layer_overhead=1e-3)
    cluster = local_cluster(1, Calibration(cores=1, alpha=0.0, beta=1.0, memory=1, **rates))
    layers, expert, row = PRESETS["small"].n_layers, 3e-4, 2e-6

    def measured(b: int, experts: bool) -> float:
        cfg = dataclasses.replace(PRESETS["small"], **calibrate.MOE) if experts else PRESETS["small"]
        planned = step_time(from_gpt_config(cfg, "small"), Training(b, 128, "fp32"), cluster,
                            Candidate(Layout(), 0, b, 1)).compute
        return planned + (layers * (4 * expert + b * 128 * 2 * row) if experts else 0.0)

    monkeypatch.setattr(calibrate, "_model_step", lambda p, b, experts=False: ((b, experts), 0))
    monkeypatch.setattr(calibrate, "_paired_median_times",
                        lambda calls, runs: [measured(*call) for call in calls])
    assert calibrate.moe_costs(rates) == pytest.approx((expert, row))


def test_zero3_kept_gathered_saves_all_but_one_gather_per_unit():
    """ZeRO-3 regathering each microbatch (forward and backward) against keeping the units
    gathered through the step: on the local cluster (hidden collectives cost their whole
    time) the difference is exactly (2M - 1) gathers per unit, M microbatches, whatever
    the reductions; under a pipeline the default keeps them."""
    from paratrain.comm.cost import collective_time

    model, training, two = load_model("small"), Training(8, 128, "fp32"), local_cluster(2, FAKE)
    base = Candidate(Layout(dp=2), 3, 2, 2)
    regather, kept = (step_time(model, training, two, base.but(reshard_after_forward=r)).dp
                      for r in (None, False))
    units = model.n_layers
    gather = collective_time("all-gather", model.num_params() * 4 / units, 2, 50e-6, 0.5e9)
    assert regather - kept == pytest.approx(units * gather * (2 * 2 - 1))
    assert base.reshards and not base.but(layout=Layout(dp=2, pp=2)).reshards
    assert base.but(reshard_after_forward=False).describe().split()[4] == "z3/keep"


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_block_activations_exact(sp):
    b, s = 2, 64
    measured = run_world(tp_block_saved_bytes, 2, sp, b, s)[0]
    predicted = paratrain_layer_activation_bytes(from_gpt_config(PRESETS["tiny"], "tiny"), s, b, t=2,
                                                 sp=sp, mode="fp32")
    # Saved for backward: everything the formula counts except the row-parallel outputs,
    # which stay alive without being saved (tests/test_plan_peaks.py sees them).
    row_parallel = 2 * 4 * 64 * b * s
    assert predicted - row_parallel == measured, (predicted, measured)
