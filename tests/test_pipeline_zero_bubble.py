"""Zero-bubble pipelines (issue 43): split backward (B then W), ZB-H1, ZBV and DualPipeV.

Without processes: the tables (validated, sends matching receives, simulated without
deadlock), their text form, the V placement, ZB-H1's bubble against the paper's formula,
the memory each holds, the errors for sizes that cannot run; one chunk's split backward
against its whole backward, bit for bit (with recompute too). In spawned worlds: parity
with one process (losses, gradients, parameters, evaluation) for each schedule at pp2
and pp4, under dp2 x pp2 with the data-parallel reduction started at W, and through the
trainer under dp2 x pp2 with ZeRO-1 and ZeRO-3, clipping off and on, and tp2+SP x pp2.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_world
from paratrain.layout import Layout
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT
from paratrain.parallel.pipeline import (Action, ScheduleError, check, dump_tables, load_tables,
                                         schedule, simulate, split_model)
from paratrain.parallel.pipeline.schedules import (check_transfers, forward_schedule, homes,
                                                   peak_inflight, placement, rank_stages)
from paratrain.parallel.pipeline.split import backward_input, backward_weight
from paratrain.parallel.recompute import apply_recompute
from test_pipeline import CFG, assert_matches, one_thread, reference, train_pipeline  # noqa: F401
from test_zero_pipeline import assert_same, config, run_all

ZB = (("zbh1", 1), ("zbv", 2), ("dualpipev", 2))


def sizes():
    for kind, v in ZB:
        for p in (1, 2, 3, 4, 8):
            for m in range(1, 3 * p + 3):
                if kind != "dualpipev" or m >= 2 * p:
                    yield kind, v, p, m


# ---- tables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,v", ZB)
def test_tables_are_complete_matched_and_deadlock_free(kind, v):
    for k, vv, p, m in sizes():
        if k != kind:
            continue
        tables = schedule(kind, p, m, v)
        check_transfers(tables)
        simulate(tables, 1.0, 2.0)  # raises on a deadlock or a use before its producer
        where = homes(p, v, placement(kind))
        for r, actions in enumerate(tables):
            work = [(a.kind, a.microbatch, a.stage) for a in actions if not a.is_transfer]
            own = rank_stages(r, p, v, placement(kind))
            assert all(where[s] == r for s in own)
            assert sorted(work) == sorted((k2, mb, s) for k2 in "FBW" for mb in range(m)
                                          for s in own
                                          if k2 != "W" or ("W", mb, s) in work), (p, m, r)
            for kk, mb, s in work:
                if kk == "W":  # after its own B, on the same rank
                    assert work.index(("B", mb, s)) < work.index(("W", mb, s))
        assert load_tables(dump_tables(tables)) == tables


def test_w_notation_round_trips_and_v_places_both_ends_on_rank_0():
    assert Action.parse("1W3") == Action("W", 3, 1)
    assert str(Action("W", 3, 1)) == "1W3"
    with pytest.raises(ScheduleError, match="a computation does not"):
        Action.parse("1W3>0")
    assert homes(4, 2, "v") == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages(1, 4, 2, "v") == [1, 6]
    assert placement("zbv") == placement("dualpipev") == "v" and placement("zbh1") == "loop"
    # Stage 3 hands over to stage 4 in memory on rank 3: no transfer between them.
    tables = schedule("zbv", 4, 8, 2)
    assert not [a for a in tables[3] if a.is_transfer and a.stage in (3, 4)
                and a.peer == 3]
    fwd = forward_schedule(4, 2, 2, "v")
    assert {a.stage for a in fwd[0] if a.kind == "F"} == {0, 7}


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 24)])
@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (1, 2, 1), (2, 3, 2), (1, 1.5, 1)])
def test_zbh1_bubble_equals_the_papers_formula(p, m, f, b, w):
    """Qi et al. (2024), section 3: ZB-H1 idles (p - 1)(T_F + T_B - T_W) per rank, against
    1F1B's (p - 1)(T_F + T_B + T_W); T_B is the input gradient's share, T_W the weights'.
    The paper draws it with T_W = T_F; a W shorter than F leaves part of each cool-down
    gap open (the formula is then a lower bound; docs/pipeline.md)."""
    whole = b + w
    zb = simulate(schedule("zbh1", p, m), f, whole, w_cost=w)
    assert zb.makespan == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
    want = (p - 1) * (f + b - w) / (m * (f + b + w) + (p - 1) * (f + b - w))
    assert zb.bubble == pytest.approx(want)
    one = simulate(schedule("1f1b", p, m), f, whole)
    assert one.makespan == pytest.approx((m + p - 1) * (f + whole))
    assert zb.bubble < one.bubble


def test_memory_zbh1_and_zbv_at_1f1b_peak_dualpipev_above():
    for p, m in ((2, 8), (4, 8), (4, 16)):
        one = peak_inflight("1f1b", p, m)
        assert peak_inflight("zbh1", p, m) == [max(one)] * p  # 1F1B's first-stage peak
        assert max(peak_inflight("zbv", p, m, 2)) == max(one)
        assert max(peak_inflight("dualpipev", p, m, 2)) == p + 0.5
        for kind, v in ZB:
            sim = simulate(schedule(kind, p, m, v), 1.0, 2.0)
            assert sim.peak_inflight == peak_inflight(kind, p, m, v)
            assert sim.bubble < simulate(schedule("1f1b", p, m), 1.0, 2.0).bubble


@pytest.mark.parametrize("kind,p,m,v,match", [
    ("zbv", 2, 4, 1, "virtual-stages 2"), ("dualpipev", 4, 4, 3, "virtual-stages 2"),
    ("dualpipev", 4, 6, 2, "microbatches 8"), ("zbh1", 2, 4, 2, "virtual-stages 1"),
    ("zbx", 2, 4, 1, "zbh1, zbv, dualpipev")])
def test_sizes_that_cannot_run_are_refused_with_the_fix(kind, p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        check(kind, p, m, v)


def test_config_refuses_bad_zero_bubble_sizes_before_any_process(tmp_path):
    from paratrain.train.config import ConfigError

    with pytest.raises(ConfigError, match="virtual-stages 2"):
        config(str(tmp_path), pp=2, schedule="zbv", microbatches=4)
    with pytest.raises(ConfigError, match="microbatches"):
        config(str(tmp_path), pp=2, schedule="dualpipev", virtual_stages=2, microbatches=2)
    with pytest.raises(ConfigError, match="tied embeddings with --schedule zbv"):
        config(str(tmp_path), pp=2, schedule="zbv", virtual_stages=2, microbatches=4,
               tie_embeddings=True)
    config(str(tmp_path), pp=2, schedule="zbv", virtual_stages=2, microbatches=4)
    config(str(tmp_path), pp=2, schedule="zbh1", microbatches=4, tie_embeddings=True)


# ---- split backward, one process ------------------------------------------------------------


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_b_then_w_equals_one_backward_bit_for_bit(recompute):
    """Two microbatches accumulated on a middle chunk and on the last (loss) chunk: the
    input gradients and every parameter's .grad equal a whole backward's exactly, and B
    alone writes no .grad."""
    torch.manual_seed(0)
    for index in (0, 1):
        whole = split_model(GPT(CFG), 1, 2, 2)[index]  # stages 1 and 3 (the loss)
        halves = copy.deepcopy(whole)
        for chunk in (whole, halves):  # after the copy: recompute wraps the instance's forward
            apply_recompute(chunk.blocks(), recompute)
        results = []
        for chunk, split in ((whole, False), (halves, True)):
            torch.manual_seed(1)
            grads_in = []
            for _ in range(2):
                x = torch.randn(2, 16, CFG.d_model, requires_grad=True)
                out = chunk(x, torch.randint(0, CFG.vocab_size, (2, 16)) if chunk.is_last else None)
                g = torch.randn_like(out)
                if split:
                    before = [None if p.grad is None else p.grad.clone() for p in chunk.parameters()]
                    dx, kept = backward_input(out, g, x, list(chunk.parameters()))
                    assert all((p.grad is None and b is None) or torch.equal(p.grad, b)
                               for p, b in zip(chunk.parameters(), before))
                    backward_weight(kept)
                else:
                    out.backward(g)
                    dx = x.grad
                grads_in.append(dx)
            results.append((grads_in, [p.grad for p in chunk.parameters()]))
        (dx_a, g_a), (dx_b, g_b) = results
        assert all(torch.equal(a, b) for a, b in zip(dx_a, dx_b))
        assert len(g_a) == len(g_b) and all(torch.equal(a, b) for a, b in zip(g_a, g_b))


def test_a_first_stage_runs_its_whole_backward_at_w():
    torch.manual_seed(0)
    chunk = split_model(GPT(CFG), 0, 2)[0]
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    out = chunk(tokens)
    dx, kept = backward_input(out, torch.ones_like(out), None, list(chunk.parameters()))
    assert dx is None and all(p.grad is None for p in chunk.parameters())
    backward_weight(kept)
    assert all(p.grad is not None for p in chunk.parameters())


def tp_split_world() -> dict:
    """On tp2 with sequence parallelism: one middle chunk's backward whole, and split into
    B and W on an identical copy. Counts the collectives and the fused entry's weight GEMMs
    in each pass."""
    from paratrain.comm import collectives as C
    from paratrain.parallel import sequence
    from paratrain.parallel.tensor import apply_tensor_parallel

    torch.set_num_threads(1)
    mesh = Mesh.build(Layout(tp=2))
    chunks = []
    for _ in range(2):
        torch.manual_seed(0)
        model = GPT(CFG)
        apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=True)
        chunks.append(split_model(model, 1, 2, 2)[0])  # stage 1 of 4
    counts = {"collectives": 0, "weight_gemms": 0}
    originals = {n: getattr(C, n) for n in ("all_reduce", "reduce_scatter", "all_gather")}
    gemms = sequence._weight_grads

    def counted(fn, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return call

    for n, fn in originals.items():
        setattr(C, n, counted(fn, "collectives"))
    sequence._weight_grads = counted(gemms, "weight_gemms")
    torch.manual_seed(1)
    x = torch.randn(2, 16 // 2, CFG.d_model)
    g = torch.randn(2, 16 // 2, CFG.d_model)
    seen = {}
    try:
        for chunk, split in zip(chunks, (False, True)):
            xi = x.clone().requires_grad_()
            out = chunk(xi, None, torch.arange(16))
            counts.update(collectives=0, weight_gemms=0)
            if split:
                dx, kept = backward_input(out, g, xi, list(chunk.parameters()))
                seen["B"] = dict(counts)
                counts.update(collectives=0, weight_gemms=0)
                backward_weight(kept)
                seen["W"] = dict(counts)
            else:
                out.backward(g)
                dx = xi.grad
                seen["whole"] = dict(counts)
            seen[split] = (dx, [p.grad for p in chunk.parameters()])
    finally:
        for n, fn in originals.items():
            setattr(C, n, fn)
        sequence._weight_grads = gemms
    (dx_a, g_a), (dx_b, g_b) = seen[False], seen[True]
    return {"equal": torch.equal(dx_a, dx_b) and all(torch.equal(a, b) for a, b in zip(g_a, g_b)),
            "B": seen["B"], "W": seen["W"], "whole": seen["whole"]}


def test_tp_split_backward_moves_the_fused_entrys_weight_gemms_to_w():
    """tp2+SP: B runs every collective and no weight GEMM of the fused column entry, W
    runs those GEMMs and no collective; B then W equals the whole backward bit for bit."""
    for rank in run_world(tp_split_world, 2):
        assert rank["equal"]
        whole, b, w = rank["whole"], rank["B"], rank["W"]
        assert whole["weight_gemms"] > 0 and b["weight_gemms"] == 0
        assert w["weight_gemms"] == whole["weight_gemms"]
        assert b["collectives"] == whole["collectives"] > 0 and w["collectives"] == 0


# ---- worlds ---------------------------------------------------------------------------------


def zb_world(pp: int, variants: list, with_dp: bool):
    results = {}
    mesh = Mesh.build(Layout(pp=pp))
    for kind, v, m in variants:
        results[(f"pp{pp}", kind, m)] = train_pipeline(mesh, kind, v, m)
    if with_dp:
        mesh = Mesh.build(Layout(dp=2, pp=2))
        for kind, v in ZB:
            results[("dp2pp2", kind, 4)] = train_pipeline(mesh, kind, v, 4)
        mesh = Mesh.build(Layout(tp=2, pp=2))
        for kind, v in ZB:
            results[("tp2pp2", kind, 4)] = train_pipeline(mesh, kind, v, 4)
    return results


PP2 = [("zbh1", 1, 4), ("zbh1", 1, 8), ("zbv", 2, 4), ("zbv", 2, 8), ("dualpipev", 2, 4)]


def test_pp2_zero_bubble_schedules_match_single_process(reference):
    results = run_world(zb_world, 2, 2, PP2, False)
    for kind, v, m in PP2:
        assert_matches(results, ("pp2", kind, m), reference)


PP4 = [("zbh1", 1, 4), ("zbh1", 1, 8), ("zbv", 2, 4), ("zbv", 2, 8), ("dualpipev", 2, 8)]


@pytest.mark.slow
def test_pp4_dp2_pp2_tp2_pp2_zero_bubble_match_single_process(reference):
    results = run_world(zb_world, 4, 4, PP4, True, timeout_s=300)
    for kind, v, m in PP4:
        assert_matches(results, ("pp4", kind, m), reference)
    for kind, v in ZB:
        assert_matches(results, ("tp2pp2", kind, 4), reference)
        assert_matches(results, ("dp2pp2", kind, 4), reference)
        for rank_results in results:  # the reductions started at a W, not after the step
            assert rank_results[("dp2pp2", kind, 4)]["launches"] == [1.0] * 3


def test_dp2_pp2_ddp_reduces_at_w(reference):
    """One ZB-H1 run of dp2 x pp2 in the default suite: parity, and every bucket launched
    by a chunk's last W (the no_sync trick moved from B to W)."""
    results = run_world(_dp_world, 4, timeout_s=240)
    assert_matches(results, ("dp2pp2", "zbh1", 4), reference)
    assert_matches(results, ("dp2pp2", "zbv", 4), reference)
    for rank_results in results:
        for kind in ("zbh1", "zbv"):
            assert rank_results[("dp2pp2", kind, 4)]["launches"] == [1.0] * 3


def _dp_world():
    mesh = Mesh.build(Layout(dp=2, pp=2))
    return {("dp2pp2", kind, 4): train_pipeline(mesh, kind, v, 4)
            for kind, v in (("zbh1", 1), ("zbv", 2))}


# ---- through the trainer: ZeRO, clipping ----------------------------------------------------


@pytest.fixture(scope="module")
def trainer_references(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ref"))
    plain, clipped = run_world(run_all, 1, [config(tmp, nproc=1, n_layers=8),
                                            config(tmp, nproc=1, n_layers=8, grad_clip=0.3)])[0]
    assert max(plain[1]) > 0.3, "the clipping test needs a norm above its threshold"
    return plain, clipped


TRAINER_FAST = {
    "zbh1 zero1": dict(schedule="zbh1", zero=1),
    "zbv zero3": dict(schedule="zbv", virtual_stages=2, zero=3),
    "dualpipev zero1 clipped": dict(schedule="dualpipev", virtual_stages=2, zero=1, grad_clip=0.3),
}
TRAINER_SLOW = {
    "zbh1 zero3": dict(schedule="zbh1", zero=3),
    "zbh1 zero3 clipped": dict(schedule="zbh1", zero=3, grad_clip=0.3),
    "zbv zero1": dict(schedule="zbv", virtual_stages=2, zero=1),
    "zbv zero3 reshard": dict(schedule="zbv", virtual_stages=2, zero=3, reshard_after_forward="yes"),
    "zbv zero3 clipped": dict(schedule="zbv", virtual_stages=2, zero=3, grad_clip=0.3),
    "dualpipev zero3": dict(schedule="dualpipev", virtual_stages=2, zero=3),
}


def _trainer_check(trainer_references, tmp_path, variants: dict, timeout_s: float) -> None:
    plain, clipped = trainer_references
    configs = [config(str(tmp_path), dp=2, pp=2, microbatches=4, n_layers=8, **v)
               for v in variants.values()]
    for name, got in zip(variants, run_world(run_all, 4, configs, timeout_s=timeout_s)[0]):
        assert_same(got, clipped if "clipped" in name else plain, name)


def test_trainer_dp2_pp2_zero_with_zero_bubble(trainer_references, tmp_path):
    """dp2 x pp2 through ``train``, 4 microbatches per rank: ZeRO-1 and ZeRO-3 reduce at
    W; losses, grad norms, validation and parameters match one process."""
    _trainer_check(trainer_references, tmp_path, TRAINER_FAST, 240)


@pytest.mark.slow
def test_trainer_dp2_pp2_zero_with_zero_bubble_every_variant(trainer_references, tmp_path):
    _trainer_check(trainer_references, tmp_path, TRAINER_SLOW, 360)


# ---- planner ---------------------------------------------------------------------------------


def test_planner_peaks_and_idle_time_follow_the_tables():
    from paratrain.parallel.pipeline.simulator import idle_microbatches
    from paratrain.plan.memory import inflight_microbatches

    for kind, v in ZB:
        for p in (2, 3, 4, 6, 8):
            for m in range(2 * p if kind == "dualpipev" else 1, 4 * p + 1):
                assert [inflight_microbatches(kind, p, m, v, s) for s in range(p)] == \
                    peak_inflight(kind, p, m, v), (kind, p, m)
    # In units of one microbatch's work: ZB-H1 (p - 1)(F + B - W) / (F + B + W), here
    # F = B = W; past 8 ranks the simulation of 8 is scaled by (p - 1) / 7, exact for it.
    for p, m in ((4, 16), (8, 32), (16, 64), (64, 1024)):
        assert idle_microbatches("zbh1", p, m, 1, 2.0) == pytest.approx((p - 1) / 3)
        assert idle_microbatches("1f1b", p, m, 1, 2.0) == pytest.approx(p - 1)
        assert idle_microbatches("zbv", p, m, 2, 2.0) < idle_microbatches("zbh1", p, m, 1, 2.0)


def test_planner_searches_zero_bubble_beside_1f1b_and_interleaved():
    from dataclasses import replace

    from paratrain.plan.candidate import Training
    from paratrain.plan.hardware import Cluster, gpu_preset
    from paratrain.plan.models import PRESETS
    from paratrain.plan.search import search

    result = search(PRESETS["llama3-8b"], Training(64, 4096), Cluster(gpu_preset("h100-80g"), 32),
                    zero=(1,), context_parallel=False)
    plans = {p.cand: p for p in result.plans if p.cand.pp > 1}
    assert {"1f1b", "zbh1", "zbv", "dualpipev"} <= {c.schedule for c in plans}
    pairs = [(plans[replace(c, schedule="1f1b")], p) for c, p in plans.items()
             if c.schedule == "zbh1" and replace(c, schedule="1f1b") in plans]
    assert pairs
    for one, zb in pairs:  # the same layout: a smaller bubble, more activations (the price)
        assert zb.time.bubble < one.time.bubble
        assert zb.memory.activations >= one.memory.activations


# ---- trace ----------------------------------------------------------------------------------


def test_trace_draws_w_and_prints_zbh1s_formula(tmp_path, capsys):
    from paratrain.cli import main

    out = tmp_path / "zbh1.svg"
    assert main(["trace", "--schedule", "zbh1", "--pp", "4", "--microbatches", "8",
                 "--b-cost", "2", "--out", str(out)]) in (0, None)
    text = capsys.readouterr().out
    assert "simulated 11.11%" in text and "(p-1)(F+B-W)" in text and "= 11.11%" in text
    assert "W (weight gradients)" in out.read_text()
    assert main(["trace", "--schedule", "zbv", "--pp", "2", "--microbatches", "4",
                 "--out", str(out)]) == 2
    assert "--virtual-stages 2" in capsys.readouterr().err
