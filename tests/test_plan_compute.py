"""Shape-aware compute rates, ZeRO-3 / HSDP communication, the local curve fit (pure
arithmetic, no processes)."""

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from paratrain.plan.calibrate import fit_curve
from paratrain.layout import Layout
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.compute import (attention_time, elementwise_bytes, gemm_efficiency, matmul_time,
                                    unfused_attention_time)
from paratrain.plan.cost import step_time
from paratrain.plan.dp_cost import zero3_links
from paratrain.plan.overlap import prefetched
from paratrain.plan.evaluate import parse_layout
from paratrain.plan.export import config_tables, trainable
from paratrain.plan.hardware import GB, Cluster, gpu_preset
from paratrain.plan.models import PRESETS, ModelSpec
from paratrain.plan.search import search

A100 = gpu_preset("a100-80g")


def test_curve_passes_through_the_measured_ceiling_and_falls_for_small_shapes():
    g = A100
    assert gemm_efficiency(*g.mamf_shape, g.half_dim, g.sms, g.mamf_shape) == pytest.approx(1)
    big = gemm_efficiency(8192, 8192, 8192, g.half_dim, g.sms, g.mamf_shape)
    narrow = gemm_efficiency(8192, 64, 8192, g.half_dim, g.sms, g.mamf_shape)
    assert narrow < 0.6 * big  # K = 64: the tile's fixed cost dominates
    # Wave quantization: 109 tiles of 128 x 128 on 108 SMs take two waves.
    one_wave = gemm_efficiency(128 * 108, 4096, 128, g.half_dim, g.sms, None)
    two_waves = gemm_efficiency(128 * 109, 4096, 128, g.half_dim, g.sms, None)
    assert two_waves / one_wave == pytest.approx(109 / 216, rel=1e-9)


def test_smaller_shards_run_below_the_rate_of_large_ones():
    """Per FLOP, tp8 on a small microbatch is slower than tp1: the issue's "a small shard
    looks free" no longer holds."""
    rate = A100.peak_flops * A100.efficiency

    def per_flop(m, k, n):
        return matmul_time(m, k, n, rate, A100.half_dim, A100, 2) / (2 * m * k * n)

    assert per_flop(2048, 4096, 512) > 1.1 * per_flop(2048, 4096, 4096)


def test_elementwise_passes_shard_with_sequence_parallelism():
    model = PRESETS["llama3-8b"]
    full = elementwise_bytes(model, 1024, 1, False, 2)
    plain, sp = elementwise_bytes(model, 1024, 4, False, 2), elementwise_bytes(model, 1024, 4, True, 2)
    assert sp < plain < full
    h, f = model.d_model, model.ffn_hidden
    assert full == 1024 * 2 * (10 * h + 2 * (h + 8 * 128) + 3 * f)


def test_unfused_attention_costs_more_than_flash():
    model, cluster = PRESETS["gpt3-175b"], Cluster(A100, 8)
    cand = Candidate(Layout(tp=8), 0, 1, 1)
    flash = step_time(model, Training(1, 2048), cluster, cand).compute
    unfused = step_time(model, Training(1, 2048, flash_attention=False), cluster, cand).compute
    assert unfused > 1.05 * flash
    # Beyond its two GEMMs, each one launch batched over the heads, the unfused core moves
    # the scores through HBM: written, read and written by softmax, read by softmax·V
    # (2 bytes each), and dropout's read, write and 1-byte mask.
    heads, s, d = 96 // 8, 2048, 128
    rate = A100.peak_flops * A100.efficiency
    gemms = (matmul_time(s, d, s, rate, A100.half_dim, A100, 2, heads)
             + matmul_time(s, s, d, rate, A100.half_dim, A100, 2, heads))
    core = unfused_attention_time(model, 1, s, s, 8, rate, A100.half_dim, A100, 2)
    assert core - gemms == pytest.approx(heads * s * s * (4 * 2 + 5) / A100.hbm_bw)


def test_batched_gemm_tiles_share_the_waves():
    """softmax·V of one head, (2048, 2048, 96), has 16 output tiles: alone it would leave
    92 of the A100's 108 SMs idle; Megatron's ``bmm`` runs every head in one launch, so
    384 heads' 6144 tiles fill 57 waves and only the partial tile (96 of 128 columns) and
    the short K (sat) are lost."""
    one = gemm_efficiency(2048, 2048, 96, A100.half_dim, A100.sms, A100.mamf_shape)
    batched = gemm_efficiency(2048, 2048, 96, A100.half_dim, A100.sms, A100.mamf_shape, 384)
    sat = (96 / (96 + 128)) / (2048 / (2048 + 128))
    waves = 6144 / (57 * 108)
    assert one == pytest.approx(sat * 16 / 108 * 96 / 128)
    assert batched == pytest.approx(sat * waves * 96 / 128)
    rate = A100.peak_flops * A100.efficiency
    assert matmul_time(2048, 2048, 96, rate, A100.half_dim, A100, 2, 384) == pytest.approx(
        384 * 2 * 2048 * 2048 * 96 / (rate * batched))


def test_prefetch_hides_all_but_the_first_gather():
    assert prefetched(1.0, 2.0, 10, 0.1) == pytest.approx(1.0 + 9 * 0.1)  # compute-bound
    assert prefetched(3.0, 2.0, 10, 0.1) == pytest.approx(3.0 + 9 * (1.0 + 0.2))  # comm-bound


def test_zero3_across_nodes_gets_one_nic_and_hsdp_shards_in_the_node():
    cluster = Cluster(A100, 64)
    plain, _ = zero3_links(cluster, Candidate(Layout(dp=64), 3, 1, 1))
    assert (plain.kind, plain.bw) == ("network", 22.5 * GB)
    shard, replicas = zero3_links(cluster, Candidate(Layout(dp=64), 3, 1, 1, shard_group=8))
    assert (shard.kind, replicas.bw) == ("nvlink", 22.5 * GB)  # one replica per node
    shard, replicas = zero3_links(cluster, Candidate(Layout(dp=64), 3, 1, 1, shard_group=4))
    assert replicas.bw == 2 * 22.5 * GB  # two replicas of each group per node


def test_hsdp_is_searched_on_gpus_and_written_for_train():
    from paratrain.train.config import load

    model, training = PRESETS["llama3-8b"], Training(64, 4096)
    result = search(model, training, Cluster(gpu_preset("h100-80g"), 32))
    hsdp = [p for p in result.plans if p.cand.hsdp]
    assert hsdp and all(p.cand.zero == 3 and 1 < p.cand.shard_group < p.cand.shard
                        for p in hsdp)
    assert {p.cand.shard_group for p in hsdp if p.cand.tp == p.cand.pp == 1} == {8}  # a node
    tables = config_tables(hsdp[0], model, training)
    assert tables["parallel"]["shard_group"] == hsdp[0].cand.shard_group
    cfg = load(None, {**tables["parallel"], "preset": "llama3-8b", "global_batch": 64, "seq_len": 4096,
                      "micro_batch": tables["train"]["micro_batch"]})
    assert cfg.layout.hsdp and cfg.layout.shard_group == hsdp[0].cand.shard_group
    assert trainable([hsdp[0], *result.plans], model, training).cand.hsdp
    spec = parse_layout("dp32 z3/hsdp8")
    assert (spec.zero, spec.shard_group) == (3, 8) and parse_layout("hsdp8").zero == 3
    from paratrain.layout import Layout
    from paratrain.plan.search import _hsdp_groups
    from paratrain.plan.sweep import Problem

    problem = Problem(model, training, Cluster(gpu_preset("h100-80g"), 32), None, ("none",), 1.0)
    assert _hsdp_groups(problem, Candidate(Layout(dp=32), 3, 1, 2), most=3) == [8, 16]
    assert _hsdp_groups(problem, Candidate(Layout(dp=4, tp=8), 3, 1, 16), most=3) == []  # 1 rank a node


def test_zero3_gather_choice_is_read_and_written_for_train():
    """``z3/reshard``, ``z3/keep`` and ``reshard=yes|no`` fix ZeRO-3's choice; the
    exported config carries it only where it departs from train's auto."""
    assert parse_layout("z3/keep").reshard_after_forward is False
    assert parse_layout("reshard=yes").reshard_after_forward is True
    assert parse_layout("reshard=no").zero == 3 and parse_layout("z3").reshard_after_forward is None
    with pytest.raises(ValueError, match="ZeRO-3 choice"):
        parse_layout("z1/keep")
    model, training = PRESETS["llama3-405b"], Training(128, 131072)
    result = search(model, training, Cluster(gpu_preset("h100-80g"), 16384))
    regather = next(p for p in result.plans if p.cand.pp > 1 and p.cand.zero == 3
                    and p.cand.reshards)
    assert config_tables(regather, model, training)["parallel"]["reshard_after_forward"] == "yes"
    from paratrain.plan.report import layout_label

    assert "zero3/reshard" in layout_label(regather)  # the tables show the choice
    assert "reshard_after_forward" not in config_tables(result.plans[0], model, training)["parallel"]


def test_framework_limits_narrow_the_search():
    model = ModelSpec(10, 2048, 16, 16, 8192, 32000, name="m")
    result = search(model, Training(64, 2048), Cluster(A100, 16), context_parallel=False,
                    uneven_stages=False, sequence_parallel=False)
    assert {p.cand.cp for p in result.plans} == {1}
    assert all(10 % p.cand.pp == 0 for p in result.plans)
    assert not any(p.cand.sp for p in result.plans)


def test_curve_fit_recovers_rate_and_half_dim():
    rate, half = 30e9, 24.0
    samples = [(d, rate * d / (d + half)) for d in (16, 32, 64, 128, 256, 512)]
    assert fit_curve(samples) == pytest.approx((rate, half), rel=1e-9)
    flat = [(d, 5e9) for d in (16, 64, 256)]
    assert fit_curve(flat) == pytest.approx((5e9, 0.0))


def test_plans_written_for_train_are_ones_train_runs(tmp_path, capsys):
    """``--out`` writes only a plan ``paratrain train`` accepts: where SP's split of each
    rank's tokens over tp does not divide, the search plans plain TP; a model with tied
    embeddings has no trainable plan with pp > 1 under ZeRO-2/3, and --out says why."""
    from helpers import plan

    from paratrain.plan.export import refusal

    model, training = ModelSpec(24, 3072, 24, 24, 12288, 32000, name="m24"), Training(96, 2048)
    result = search(model, training, Cluster(gpu_preset("h100-80g"), 48))
    assert {p.cand.tp for p in result.plans if p.cand.tp > 1 and not p.cand.sp} == {3, 6}
    assert all("sequence parallelism" not in (refusal(p.cand, model, training) or "")
               for p in result.plans)
    first = result.plans[0].cand
    assert "tied embeddings" in refusal(first.but(layout=replace(first.layout, pp=2), zero=2, shard_group=0), ModelSpec(
        24, 3072, 24, 24, 12288, 32000, tie_embeddings=True, name="tied"), training)
    tied = ModelSpec(24, 3072, 24, 24, 12288, 32000, tie_embeddings=True, name="tied")
    assert refusal(first.but(layout=replace(first.layout, pp=1), zero=3, shard_group=0), tied,
                   training) is None
    out = tmp_path / "plan.toml"  # GPT-3 ties its embeddings: a pipeline under ZeRO-2 is refused
    assert plan("--model", "gpt3-175b", "--gpus", "1024", "--layout", "tp8 pp8 z2", "--out", str(out)) == 2
    assert "tie_embeddings = false" in capsys.readouterr().err and not out.exists()
    assert plan("--model", "gpt3-175b", "--gpus", "1024", "--layout", "tp8 pp8 z1 rc=full", "--out", str(out)) == 0
    assert "pp = 8" in out.read_text()  # the last stage keeps a copy (parallel/pipeline/tied.py)


def test_out_picks_a_plan_that_fits_paratrains_own_runtime():
    """GPU plans are ranked with fused kernels' activations; paratrain's eager block keeps
    more, so --out passes over a winner that would not fit as paratrain holds memory."""
    from paratrain.plan.export import trainable
    from paratrain.plan.memory import rank_memory

    model, training = PRESETS["llama3-8b"], Training(512, 8192)
    cluster = Cluster(gpu_preset("h100-80g"), 64)
    plans = search(model, training, cluster).plans
    eager = rank_memory(model, training, plans[0].cand, paratrain=True).total
    assert plans[0].memory.total <= cluster.memory_limit < eager  # 71.2 vs 90.3 GiB
    chosen = trainable(plans, model, training, cluster.memory_limit)
    assert chosen is not plans[0]
    assert rank_memory(model, training, chosen.cand, paratrain=True).total <= cluster.memory_limit
    assert trainable(plans, model, training) is plans[0]  # the local cluster counts paratrain's


def test_h100_preset_fits_the_gemms_and_attention_measured_on_an_h100():
    """tests/data/h100_compute.json: benchmarks/gpu_compute.py on one H100 SXM (torch
    2.11, cuBLAS; SDPA chose cuDNN attention), the source of the H100 ``half_dim`` and
    ``attention_efficiency``. The planner's time of every measured GEMM and of attention
    forward + backward at the sequence lengths training uses stays within these bounds."""
    data = json.loads((Path(__file__).parent / "data" / "h100_compute.json").read_text())
    gpu = gpu_preset("h100-80g")
    rate = gpu.peak_flops * gpu.efficiency
    gemm = [abs(matmul_time(r["m"], r["k"], r["n"], rate, gpu.half_dim, gpu, 2) - r["s"]) / r["s"]
            for r in data["gemms"]]
    assert len(gemm) > 400 and statistics.median(gemm) < 0.12
    for r in data["attention"]:
        if r["s"] >= 2048:
            flops = 4 * r["b"] * r["heads"] * r["s"] ** 2 * r["head_dim"]
            predicted = 3 * attention_time(flops, r["s"], gpu.peak_flops * gpu.attention_efficiency,
                                           gpu.half_dim)
            measured = r["fwd_s"] + r["bwd_s"]
            assert abs(predicted - measured) < 0.15 * measured, (r["s"], predicted, measured)
