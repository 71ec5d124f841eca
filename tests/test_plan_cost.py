"""Planner time model: FLOPs, α-β communication, links, bubble (pure arithmetic)."""

import json
from dataclasses import replace

import pytest

from paratrain.layout import Layout
from paratrain.plan.candidate import Candidate, Training
from paratrain.plan.cost import ORDER, bubble_fraction, step_time
from paratrain.plan.dp_cost import max_stage_params
from paratrain.plan.flops import megatron_flops, step_flops
from paratrain.plan.hardware import (GB, Calibration, CalibrationError, Cluster, gpu_preset,
                                     load_calibration, local_cluster)
from paratrain.plan.memory import rank_states, stage_memory
from paratrain.plan.models import PRESETS, ModelSpec
from paratrain.plan.overlap import link_collective_time

BLOOM = PRESETS["bloom-176b"]


def test_bloom_throughput_from_megatron_formula():
    # BLOOM-176B: batch 2048 x 2048, full recompute, 104.70 s/iteration on 384 A100s.
    flops = megatron_flops(2048, 2048, 70, 14336, 250880, full_recompute=True)
    per_gpu = flops / (384 * 104.70)
    assert per_gpu / 1e12 == pytest.approx(149.77, rel=0.01)


def test_general_flops_match_megatron_for_the_standard_block():
    training = Training(2048, 2048)
    full = step_flops(BLOOM, training, "full")
    assert full == pytest.approx(megatron_flops(2048, 2048, 70, 14336, 250880, True), rel=1e-12)
    # Megatron's 72 form scales the logits by 3/4 as well; the logits are never recomputed.
    none = step_flops(BLOOM, training, "none")
    megatron72 = megatron_flops(2048, 2048, 70, 14336, 250880, False)
    assert none - megatron72 == pytest.approx(1.5 * 2048 * 2048 * 14336 * 250880, rel=1e-9)
    assert none == pytest.approx(megatron72, rel=6e-3)  # V/(48lh): 0.5% for BLOOM
    assert none < step_flops(BLOOM, training, "selective") < full


def test_flops_close_to_six_n_per_token():
    model, training = PRESETS["llama3-8b"], Training(64, 2048)
    six_n = 6 * model.num_params() * training.tokens
    assert step_flops(model, training) == pytest.approx(six_n, rel=0.15)


def test_bloom_layout_predicts_its_published_step_time():
    # No constant is fitted to a run: the compute rates are measured kernel ceilings
    # (plan/compute.py), and BLOOM's 2022 software stored and re-read attention scores
    # (no FlashAttention), so the prediction is optimistic, by less than 25%.
    cluster = Cluster(gpu_preset("a100-80g"), 384)
    cand = Candidate(Layout(dp=8, tp=4, pp=12), zero=1, micro_batch=2, microbatches=128,
                     schedule="1f1b", recompute="full")
    # BLOOM split 70 blocks + 2 embedding units into 12 stages of 6: the middle stages
    # run 6 blocks each, as the stages of a 72-block model do.
    model = ModelSpec(72, 14336, 112, 112, 4 * 14336, 250880, tie_embeddings=True,
                      gated_mlp=False, bias=True, norm="layernorm", name="bloom-72")
    predicted = step_time(model, Training(2048, 2048), cluster, cand).step
    assert 0.75 * 104.70 < predicted < 104.70


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (8, 32, 1), (8, 32, 4), (2, 1, 1)])
def test_bubble_share_of_the_step_equals_the_formula(p, m, v):
    model = ModelSpec(32, 1024, 16, 16, 4096, 32000, name="m")
    cluster = Cluster(gpu_preset("h100-80g"), p)
    cand = Candidate(Layout(pp=p), 0, 1, m, "interleaved" if v > 1 else "1f1b", v)
    t = step_time(model, Training(m, 1024), cluster, cand)
    busy = t.step - t.bubble - t.dp - t.optimizer
    assert t.bubble / (t.bubble + busy) == pytest.approx(bubble_fraction(p, m, v))
    assert bubble_fraction(p, m, v) == (p - 1) / (v * m + p - 1)


def test_tp_all_reduce_is_the_ring_formula():
    model = ModelSpec(4, 4096, 32, 32, 16384, 32000, name="m")
    training = Training(8, 2048, tp_backward_overlap=False)  # every collective in turn
    gpu = gpu_preset("h100-80g")
    cluster = Cluster(gpu, 8)
    cand = Candidate(Layout(tp=8), 0, 1, 8)
    nbytes = 2048 * 4096 * 2
    ring = 2 * 7 * gpu.nvlink_alpha + 2 * 7 / 8 * nbytes / gpu.nvlink_bw
    collectives = 4 * model.n_layers + 1  # 2 forward + 2 backward per block, + the head's
    assert step_time(model, training, cluster, cand).tp == pytest.approx(8 * collectives * ring)



@pytest.mark.parametrize("sp", [False, True])
def test_tp_backward_overlap_hides_the_input_gradient_reduction(sp):
    """Megatron's column-parallel backward: the input-gradient all-reduce (SP: its
    reduce-scatter; the all-gather before the row-parallel layer still waits) runs under
    the layer's weight-gradient GEMM, and what hides costs overlap_cost of itself."""
    from paratrain.comm.cost import collective_time
    from paratrain.plan.compute import matmul_time
    from paratrain.plan.flops import layer_matmuls
    from paratrain.plan.overlap import exposed

    model, gpu = ModelSpec(4, 4096, 32, 32, 16384, 32000, name="m"), gpu_preset("h100-80g")
    cluster, cand = Cluster(gpu, 8), Candidate(Layout(tp=8), 0, 1, 8, sequence_parallel=sp)
    plain, overlapped = (step_time(model, Training(8, 2048, tp_backward_overlap=o), cluster,
                                   cand).tp for o in (False, True))
    nbytes = 2048 * 4096 * 2
    hidden = collective_time("reduce-scatter" if sp else "all-reduce", nbytes, 8,
                             gpu.nvlink_alpha, gpu.nvlink_bw)
    qkv, _, mlp_in, _ = layer_matmuls(model, 2048, 8)
    saved = sum(hidden - exposed(hidden, matmul_time(k, m, n, gpu.peak_flops * gpu.efficiency,
                                                     gpu.half_dim, gpu, 2), gpu.overlap_cost)
                for m, k, n in (qkv, mlp_in))
    assert saved > 0.5 * 2 * hidden
    assert plain - overlapped == pytest.approx(8 * model.n_layers * saved)

def test_links_follow_rank_order():
    cluster = Cluster(gpu_preset("h100-80g"), 64, gpus_per_node=8)
    sizes = {"tp": 4, "cp": 2, "pp": 2, "dp": 4}
    assert cluster.link(sizes, ORDER, ("tp",)).kind == "nvlink"
    assert cluster.link(sizes, ORDER, ("cp",)).kind == "nvlink"  # 4 x 2 = 8 fits a node
    pp = cluster.link(sizes, ORDER, ("pp",), p2p=True)
    assert (pp.kind, pp.bw) == ("network", 45 * GB)  # one NIC per hop
    dp = cluster.link({"tp": 2, "cp": 1, "pp": 1, "dp": 32}, ORDER, ("cp", "dp"))
    assert (dp.kind, dp.bw) == ("network", 4 * 45 * GB)  # 4 members per node, 4 NICs
    assert Cluster(gpu_preset("h100-80g"), 8).link({"tp": 3, "cp": 1, "pp": 1, "dp": 1},
                                                   ORDER, ("tp",)).kind == "network"


def test_overrides_change_the_links():
    cluster = Cluster(gpu_preset("a100-80g"), 16, intra_bw=100 * GB, inter_bw=10 * GB)
    sizes = {"tp": 8, "cp": 1, "pp": 1, "dp": 2}
    assert cluster.link(sizes, ORDER, ("tp",)).bw == 100 * GB
    assert cluster.link(sizes, ORDER, ("dp",)).bw == 10 * GB


def test_dp_overlap_hides_gradient_reduction_behind_backward():
    model, training = PRESETS["llama3-8b"], Training(256, 4096)
    fast = Cluster(gpu_preset("h100-80g"), 64)
    slow = Cluster(gpu_preset("h100-80g"), 64, inter_bw=1 * GB)
    cand = Candidate(Layout(dp=64), 0, 1, 4)
    hidden, exposed = step_time(model, training, fast, cand), step_time(model, training, slow, cand)
    assert hidden.dp < 0.01 * hidden.step
    assert exposed.dp > 10 * hidden.dp
    # ZeRO-1's updated parameters come back by an all-gather the optimizer step waits for:
    # nothing hides it (16 GB of bf16 weights over 64 ranks, ~40 ms on this cluster).
    zero1 = step_time(model, training, fast, cand.but(zero=1))
    assert zero1.dp > 4 * hidden.dp


def test_dp_reduction_after_the_backward_is_wholly_exposed():
    """2021's Megatron all-reduced after the whole backward (``dp_overlap=False``): the
    step pays the full ring time, where overlapped it hides behind the last backward."""
    model, cluster = PRESETS["llama3-8b"], Cluster(gpu_preset("h100-80g"), 64)
    cand = Candidate(Layout(dp=64), 0, 1, 4)
    beside = step_time(model, Training(256, 4096), cluster, cand)
    after = step_time(model, Training(256, 4096, dp_overlap=False), cluster, cand)
    link = cluster.link(cand.sizes(), ORDER, ("cp", "dp"))
    ring = link_collective_time(cluster, link, "all-reduce", model.stage_params(1, 1, 0) * 2, 64)
    assert after.dp == pytest.approx(ring, rel=1e-3) and beside.dp < 0.5 * after.dp
    assert after.compute == beside.compute


@pytest.mark.parametrize("zero,shard", [(0, 1), (1, 64)])
def test_fp32_gradient_copy_costs_four_bytes_per_parameter(zero, shard):
    """Megatron 2021's fp16 optimizer kept ``main_param.grad = grad.float()`` alive: 20
    bytes of model state per parameter without ZeRO, the extra 4 sharded with ZeRO-1."""
    model = PRESETS["llama3-8b"]
    cand = Candidate(Layout(dp=64), zero, 1, 4)
    plain = stage_memory(model, Training(256, 4096), cand, 0)
    copy = stage_memory(model, Training(256, 4096, fp32_grad_copy=True), cand, 0)
    psi = model.stage_params(1, 1, 0, 1)
    assert copy.optimizer - plain.optimizer == pytest.approx(4 * psi / shard)
    assert (copy.params, copy.grads, copy.activations) == (plain.params, plain.grads,
                                                           plain.activations)
    assert copy.states - plain.states == pytest.approx(
        rank_states(model, Training(256, 4096, fp32_grad_copy=True), cand)
        - rank_states(model, Training(256, 4096), cand))


def test_cluster_validation_and_presets():
    with pytest.raises(ValueError, match="whole nodes"):
        Cluster(gpu_preset("h100-80g"), 12, gpus_per_node=8)
    with pytest.raises(ValueError, match="a100-40g"):
        gpu_preset("v100")
    assert gpu_preset("H200").memory > gpu_preset("h100-80g").memory


def test_calibration_file(tmp_path):
    with pytest.raises(CalibrationError, match="--calibrate"):
        load_calibration(tmp_path / "missing.json")
    cal = Calibration({"fp32": 50e9}, cores=2, alpha=20e-6, beta=0.8e9, memory=8 * 2**30)
    path = tmp_path / "cal.json"
    path.write_text(cal.to_json())
    assert load_calibration(path) == cal
    cluster = local_cluster(4, cal)
    assert cluster.gpu.peak_flops_fp32 == 25e9  # 4 processes share 2 cores
    assert cluster.link({"tp": 2, "cp": 1, "pp": 1, "dp": 2}, ORDER, ("dp",)).bw == 0.8e9
    path.write_text(json.dumps({**json.loads(cal.to_json()), "extra": 1}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_calibration(path)


def test_sequence_parallel_is_timed_as_its_own_collectives():
    # Measured apart (gloo: reduce-scatter slower than all-reduce), SP costs what its
    # all-gather and reduce-scatter cost; sharing alpha and beta, exactly the all-reduce.
    from paratrain.plan.cost import _tp_time
    from paratrain.plan.hardware import local_cluster

    fits = {"all-reduce": [1e-4, 1e9], "all-gather": [1e-4, 1e9], "reduce-scatter": [2e-3, 0.3e9]}
    cal = Calibration({"fp32": 40e9}, cores=2, alpha=1e-4, beta=1e9, memory=4 << 30, comm={"2": fits})
    model = PRESETS["llama3-8b"]
    training = Training(8, 128, "fp32", tp_backward_overlap=False)
    plain, sp = (Candidate(Layout(tp=2), 0, 8, 1, sequence_parallel=s) for s in (False, True))
    local = local_cluster(2, cal)
    assert _tp_time(model, training, local, sp) > 1.5 * _tp_time(model, training, local, plain)
    h100 = Cluster(gpu_preset("h100-80g"), 8)
    assert _tp_time(model, training, h100, sp) == pytest.approx(_tp_time(model, training, h100, plain))


def test_ulysses_is_timed_as_its_all_to_alls_and_searched_where_heads_split():
    from paratrain.comm.cost import collective_time
    from paratrain.plan.evaluate import evaluate, parse_layout
    from paratrain.plan.export import config_tables
    from paratrain.plan.search import search

    model, training = PRESETS["llama3-8b"], Training(16, 8192, "bf16")  # 32 heads, 8 KV heads
    cluster = Cluster(gpu_preset("h100-80g"), 8)
    ring = Candidate(Layout(tp=2, cp=4), 0, 1, 16, recompute="full")
    uly = ring.but(cp_method="ulysses")
    link = cluster.link(uly.sizes(), ORDER, ("cp",))
    tokens = 8192 // 4
    q, kv = (tokens * heads * 128 * 2 for heads in (32 // 2, 8 // 2))  # per tp rank, bf16
    one_way = sum(collective_time("all-to-all", n, 4, link.alpha, link.bw) for n in (q, kv, kv, q))
    # forward, backward and full recompute's second forward: 3 x 4 all-to-alls per block
    assert step_time(model, training, cluster, uly).cp == pytest.approx(16 * 32 * 3 * one_way)
    assert step_time(model, training, cluster, uly).cp != step_time(model, training, cluster, ring).cp
    # The search times both where cp divides each rank's heads (8 KV heads / tp2 = 4 here)...
    def methods(**options) -> set:
        return {(p.cand.tp, p.cand.cp, p.cand.cp_method) for p in search(
            model, training, Cluster(gpu_preset("h100-80g"), 16), micro_batch=1,
            recompute="full", zero=(0,), **options).plans}

    both = methods()
    assert {(2, 4, "ring"), (2, 4, "ulysses"), (4, 2, "ring"), (4, 2, "ulysses")} <= both
    assert (4, 4, "ring") in both and (4, 4, "ulysses") not in both  # 2 KV heads per rank
    assert (2, 8, "ring") in both and (2, 8, "ulysses") not in both
    assert {m for _, _, m in methods(ulysses=False)} == {"ring"}
    # ... and --layout names it, evaluates it and writes it to the run's config.
    spec = parse_layout("tp2 cp4/ulysses mb1 rc=full z0")
    assert spec.cp_method == "ulysses" and parse_layout("cp4 ring").cp_method == "ring"
    found = search(model, training, cluster, micro_batch=1, recompute="full", zero=(0,))
    best = evaluate(spec, model, training, cluster, found)
    assert best.cand.cp_method == "ulysses" and best.time.cp == pytest.approx(16 * 32 * 3 * one_way)
    plan = next(p for p in found.plans if p.cand == best.cand)
    assert config_tables(plan, model, training)["parallel"]["cp_method"] == "ulysses"


def test_ring_attention_exchange_as_ring_py_runs_it():
    """Per block and microbatch: K, V round the ring forward (cp - 1 hops); in backward K,
    V again (cp - 1) and dK, dV in fp32 one hop further home (cp); selective recompute
    repeats the forward's exchange, since under CP the recomputed core is the ring
    attention. On the local cluster every hidden byte costs its time, so the sum is exact."""
    from paratrain.comm.cost import p2p_time
    from paratrain.plan.hardware import Calibration, local_cluster

    from paratrain.plan.models import load_model

    cal = Calibration(matmul_flops={"fp32": 40e9, "bf16": 100e9}, cores=2, alpha=1e-4,
                      beta=1e9, memory=8 * 2**30)
    cluster, model = local_cluster(4, cal), load_model("small")
    assert cluster.gpu.overlap_cost == 1.0
    training = Training(8, 128, "bf16")
    cand = Candidate(Layout(cp=4), 0, 2, 4)
    link = cluster.link(cand.sizes(), ORDER, ("cp",), p2p=True)
    kv = 2 * 2 * 128 // 4 * model.kv_heads_per_rank(1) * model.head_dim
    step, grad = (p2p_time(kv * b, link.alpha, link.bw) for b in (2, 4))
    per_block = 3 * step + (3 * step + 4 * grad)
    assert step_time(model, training, cluster, cand).cp == pytest.approx(
        4 * model.n_layers * per_block)
    selective = step_time(model, training, cluster, cand.but(recompute="selective")).cp
    assert selective == pytest.approx(4 * model.n_layers * (per_block + 3 * step))


def test_hidden_collectives_cost_cpu_processes_their_whole_time():
    # Measured (docs/plan.md): with every core computing, a collective in flight beside
    # compute costs the step about its whole time, latency included; with a spare core
    # it hides as on a GPU (0.1 of it).
    from paratrain.comm.cost import collective_time

    fits = {"all-reduce": [2e-3, 1e9]}
    cal = Calibration({"fp32": 40e9}, cores=2, alpha=2e-3, beta=1e9, memory=4 << 30,
                      comm={"2": fits})
    model = PRESETS["llama3-8b"]
    training = Training(8, 128, "fp32")
    ddp = Candidate(Layout(dp=2), zero=0, micro_batch=4, microbatches=1)
    reduce = collective_time("all-reduce", 4 * max_stage_params(model, ddp), 2, 2e-3, 1e9)
    full = step_time(model, training, local_cluster(2, cal), ddp)
    assert full.dp == pytest.approx(reduce)  # hidden behind a longer backward, still paid
    spare = step_time(model, training, local_cluster(2, replace(cal, cores=4)), ddp)
    assert spare.dp == pytest.approx(0.1 * reduce)
