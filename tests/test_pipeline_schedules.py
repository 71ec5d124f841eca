"""Pipeline schedules as pure tables: structure, matched transfers, no deadlock, bubble and
in-flight microbatches against the papers' formulas; the trace command. No processes."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from paratrain.parallel.pipeline.posting import (batches, held_buffers, posting_order,
                                                 sends_before)
from paratrain.parallel.pipeline.schedules import (Action, ScheduleError, check, check_transfers,
                                                   forward_schedule, notes, owner, peak_inflight,
                                                   schedule)
from paratrain.parallel.pipeline.simulator import simulate
from paratrain.parallel.pipeline.timeline import Interval, StepRecord, Timeline
from paratrain.plan.memory import inflight_microbatches


def valid_grid():
    """Every valid (kind, stages, microbatches, chunks) with stages 1..8, microbatches
    1..16, chunks 1..4."""
    for kind in ("gpipe", "1f1b", "interleaved"):
        for p in range(1, 9):
            for m in range(1, 17):
                for v in range(1, 5):
                    try:
                        check(kind, p, m, v)
                    except ScheduleError:
                        continue
                    yield kind, p, m, v


GRID = list(valid_grid())


def test_grid_covers_every_schedule():
    kinds = {k for k, *_ in GRID}
    assert kinds == {"gpipe", "1f1b", "interleaved"}
    assert {v for k, _, _, v in GRID if k == "interleaved"} == {2, 3, 4}
    assert len(GRID) > 300


def test_each_computation_runs_once_on_its_owner_and_every_backward_follows_its_forward():
    for kind, p, m, v in GRID:
        tables = schedule(kind, p, m, v)
        for r, actions in enumerate(tables):
            seen: dict[tuple[str, int, int], int] = {}
            for i, a in enumerate(actions):
                if a.kind in ("F", "B"):
                    assert owner(a.stage, p) == r
                    assert (a.kind, a.microbatch, a.stage) not in seen
                    seen[(a.kind, a.microbatch, a.stage)] = i
            expected = {(k, mb, c * p + r) for k in "FB" for mb in range(m) for c in range(v)}
            assert set(seen) == expected, (kind, p, m, v, r)
            for _, mb, s in [key for key in seen if key[0] == "B"]:
                assert seen[("F", mb, s)] < seen[("B", mb, s)]


def test_sends_match_receives_in_the_same_order_on_both_sides():
    for kind, p, m, v in GRID:
        tables = schedule(kind, p, m, v)
        check_transfers(tables)  # raises on any mismatch
        for r, actions in enumerate(tables):
            for a in actions:
                if a.kind == "SEND_F":
                    assert a.peer == owner(a.stage + 1, p) != r
                if a.kind == "SEND_B":
                    assert a.peer == owner(a.stage - 1, p) != r
        # every stage boundary between ranks carries each microbatch once each way
        transfers = sum(a.kind.startswith("SEND") for t in tables for a in t)
        assert transfers == (0 if p == 1 else 2 * m * (p * v - 1))


def test_unmatched_order_is_rejected():
    tables = schedule("gpipe", 2, 2)
    receives = [i for i, a in enumerate(tables[1]) if a.kind == "RECV_F"]
    i, j = receives
    tables[1][i], tables[1][j] = tables[1][j], tables[1][i]  # receive microbatch 1 first
    with pytest.raises(ScheduleError, match="same order"):
        check_transfers(tables)


def test_no_deadlock_and_unit_cost_bubble_is_exactly_the_papers():
    """With forward = backward = 1, every rank computes 2·v·m units and the step lasts
    2·(v·m + p - 1) units, so idle / total = (p-1)/(v·m+p-1), exactly."""
    for kind, p, m, v in GRID:
        sim = simulate(schedule(kind, p, m, v), f_cost=1, b_cost=1)
        assert sim.makespan == 2 * (v * m + p - 1), (kind, p, m, v)
        assert sim.busy == [2 * v * m] * p
        bubble = Fraction(p - 1, v * m + p - 1)
        assert sim.bubble == pytest.approx(float(bubble), abs=1e-12)
        assert sim.bubbles == pytest.approx([float(bubble)] * p, abs=1e-12)


def test_forward_only_tables_for_evaluation_run_without_a_bubble_beyond_fill_and_drain():
    for p in range(1, 9):
        for m in range(p, 17):
            for v in range(1, 5):
                tables = forward_schedule(p, m, v)
                assert {a.kind for t in tables for a in t} <= {"F", "SEND_F", "RECV_F"}
                assert simulate(tables, f_cost=1).makespan == v * m + p - 1


def test_backward_twice_forward_keeps_the_bubble_for_gpipe_and_1f1b():
    for kind, p, m, v in GRID:
        sim = simulate(schedule(kind, p, m, v), f_cost=1, b_cost=2)
        ideal = 3 * (v * m + p - 1)
        if kind == "interleaved":  # lock-step transfers cost a little when b != f
            assert ideal <= sim.makespan <= 1.1 * ideal
        else:
            assert sim.makespan == ideal, (kind, p, m)


def test_peak_in_flight_microbatches():
    for kind, p, m, v in GRID:
        sim = simulate(schedule(kind, p, m, v))
        assert sim.peak_inflight == peak_inflight(kind, p, m, v)
        if kind == "gpipe":
            assert sim.peak_inflight_chunks[0] == m
        if kind == "1f1b":
            assert sim.peak_inflight_chunks[0] == min(p, m) <= p
        # the planner's closed form agrees with the tables on the first and last stage
        for stage in (0, p - 1):
            assert sim.peak_inflight[stage] == inflight_microbatches(kind, p, m, v, stage) or p == 1


def test_deadlock_is_detected():
    # rank 0 waits for the gradient before sending the activation that produces it
    tables = [
        [Action("F", 0, 0), Action("RECV_B", 0, 0, 1), Action("B", 0, 0),
         Action("SEND_F", 0, 0, 1)],
        [Action("RECV_F", 0, 1, 0), Action("F", 0, 1), Action("B", 0, 1),
         Action("SEND_B", 0, 1, 0)],
    ]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(tables)


def test_bad_configurations_name_the_fix():
    with pytest.raises(ScheduleError, match="multiple of 4"):
        check("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="--schedule interleaved"):
        check("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="--schedule 1f1b"):
        check("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match="pick one of"):
        check("zero-bubble", 4, 8)
    check("1f1b", 4, 2)  # valid, but says what it costs
    assert "never fills" in notes("1f1b", 4, 2)[0] and notes("1f1b", 4, 8) == []


def test_simulator_is_fast_enough_for_the_planner():
    sim = simulate(schedule("1f1b", 32, 128))
    assert sim.peak_inflight_chunks[0] == 32
    planner = inflight_microbatches("interleaved", 64, 512, 2)
    assert peak_inflight("interleaved", 64, 512, 2)[0] == planner


# ---- trace ----------------------------------------------------------------------------------


def test_trace_draws_a_schedule_and_a_recorded_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import argparse

    from paratrain import trace_cli

    parser = argparse.ArgumentParser()
    trace_cli.add_parser(parser.add_subparsers())
    out = tmp_path / "schedule.png"
    args = parser.parse_args(["trace", "--schedule", "interleaved", "--pp", "2",
                              "--microbatches", "4", "--virtual-stages", "2", "--out", str(out)])
    assert args.func(args) == 0
    assert out.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "simulated 11.11%" in printed and "theory (p-1)/(v*m+p-1) = 11.11%" in printed

    timeline = Timeline("1f1b", 2, 2, 1, [
        [StepRecord(4.0, [Interval("F", 0, 0, 0, 1), Interval("F", 1, 0, 1, 2),
                          Interval("B", 0, 0, 2, 3), Interval("B", 1, 0, 3, 4)])],
        [StepRecord(4.0, [Interval("WAIT", -1, -1, 0, 1), Interval("F", 0, 1, 1, 2),
                          Interval("B", 0, 1, 2, 3), Interval("F", 1, 1, 3, 4)])],
    ])
    assert timeline.bubbles() == [0.0, 0.25]
    timeline.save(tmp_path / "run.json")
    svg = tmp_path / "run.svg"
    args = parser.parse_args(["trace", "--run", str(tmp_path / "run.json"), "--out", str(svg)])
    assert args.func(args) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    printed = capsys.readouterr().out  # the mean and the drawn step's figures, each named
    assert "mean of steps 1..1: 12.50% (per rank 0.00% 25.00%)" in printed, printed
    assert "step 1, drawn: per rank 0.00% 25.00%" in printed, printed


def test_simulator_takes_unequal_stage_costs():
    # 1F1B, p=2, m=4, the last stage twice as slow: it paces the pipeline, so the step is
    # the first forward, four of its (F + B), and the first stage's last backward.
    sim = simulate(schedule("1f1b", 2, 4), f_cost=1, b_cost=2,
                   stage_costs={("F", 1): 2, ("B", 1): 4})
    assert sim.makespan == 1 + 4 * (2 + 4) + 2
    assert sim.busy == [12, 24] and abs(sim.bubble - (1 - 36 / 54)) < 1e-12


def test_simulator_charges_each_post_to_its_rank():
    # GPipe, p=2, m=1: rank 0 posts (send x, receive g) after its forward; rank 1 posts its
    # receive first (off the critical path) and its send after the backward: two posts on
    # the critical path, each delaying everything after it.
    tables = schedule("gpipe", 2, 1)
    assert simulate(tables).makespan == 6
    sim = simulate(tables, post_cost=0.25)
    assert sim.makespan == 6.5 and sim.busy == [3, 3]
    assert [(i.start, i.end) for i in sim.intervals[1] if i.kind == "POST"] == [(0, 0.25), (4.25, 4.5)]


# ---- posting receives early (gloo) ---------------------------------------------------------


def _computes_before(items, action) -> int:
    """Computations that run before ``action`` is posted in ``items``."""
    count = 0
    for item in items:
        if isinstance(item, list):
            if action in item:
                return count
        else:
            count += 1
    raise AssertionError(f"{action} is never posted")


@pytest.mark.parametrize("ahead", [1, 2, 5])
def test_receives_posted_early_keep_their_order_and_sends_their_place(ahead):
    tables = [(f"{kind} p{p} m{m} v{v}", t) for kind, p, m, v in GRID[::7]
              for t in schedule(kind, p, m, v)]
    tables += [(f"forward p{p} v{v}", t) for p in (2, 3) for v in (1, 2)
               for t in forward_schedule(p, 2 * p, v)]
    for name, actions in tables:
        table, early = batches(actions), posting_order(actions, ahead)
        flat = [a for item in early for a in (item if isinstance(item, list) else [item])]
        assert sorted(map(str, flat)) == sorted(map(str, actions)), name
        assert [a for a in flat if not a.is_transfer] == [a for a in actions if not a.is_transfer]
        for a in (a for a in actions if a.is_transfer):
            placed, posted = _computes_before(table, a), _computes_before(early, a)
            want = placed if a.kind.startswith("SEND") else max(placed - ahead, 0)
            assert posted == want, (name, str(a))
        for peer in {a.peer for a in actions if a.is_transfer}:  # matching by order
            receives = [a for a in actions if a.kind.startswith("RECV") and a.peer == peer]
            assert [a for a in flat if a in receives] == receives, name
        for item in (i for i in early if isinstance(i, list)):  # a moved receive is alone:
            moved = [a for a in item if a.kind.startswith("RECV")  # its compute waits for it only
                     and _computes_before(early, a) < _computes_before(table, a)]
            assert not moved or item == moved == [moved[0]], (name, item)


def test_receive_buffers_held_count_those_posted_early():
    assert posting_order(schedule("1f1b", 2, 8)[1], 0) == batches(schedule("1f1b", 2, 8)[1])
    expected = {("gpipe", 2, 8, 1): [(1, 3), (1, 3)], ("1f1b", 2, 8, 1): [(1, 2), (1, 2)],
                ("1f1b", 4, 8, 1): [(1, 3), (2, 4), (2, 4), (1, 2)],
                ("interleaved", 2, 4, 2): [(1, 3), (3, 5)]}
    for (kind, p, m, v), want in expected.items():
        tables = schedule(kind, p, m, v)
        got = [(held_buffers(t, 0)[0], held_buffers(t, 2)[0]) for t in tables]
        assert got == want, kind


def test_sent_tensors_are_held_until_a_receive_waits_for_them():
    """A computation waits for the sends its table placed before its input's receive (or
    in the same batch); until then each sent tensor is held. Early posting moves receives,
    not these waits."""
    first, last = schedule("gpipe", 2, 4)
    # Stage 0 sends 4 outputs, one batch each, before its first gradient arrives.
    assert [sends_before(first)[a] for a in first if a.kind == "RECV_B"] == [4] * 4
    # Stage 1 receives each input before sending anything; its gradients go out one per
    # backward and are waited for at the end of the step.
    assert [sends_before(last)[a] for a in last if a.kind == "RECV_F"] == [0] * 4
    for ahead in (0, 2):
        # While the last forward runs, the 3 outputs before it; the first backward waits
        # for all 4 sends.
        assert held_buffers(first, ahead)[1] == 3
        assert held_buffers(last, ahead)[1] == 3  # the gradients sent before the last backward
        # 1F1B: stage 0's warm-up forwards, then one send at a time.
        assert [held_buffers(t, ahead)[1] for t in schedule("1f1b", 4, 8)] == [3, 1, 1, 1]


def test_measured_bubble_counts_a_rank_idle_until_the_pipeline_ends():
    """Each rank's compute against the pipeline's makespan (wall-clock origins), not its
    own span: the last stage leaves early and sat idle until the first stage finished.
    One forward and backward of unit cost each on two stages, one microbatch: each rank
    computes 2 of the makespan's 4 units, (p-1)/(m+p-1) = 50%."""
    first = StepRecord(4.0, [Interval("F", 0, 0, 0, 1), Interval("WAIT", -1, -1, 1, 3),
                             Interval("B", 0, 0, 3, 4)], origin=100.0)
    last = StepRecord(2.0, [Interval("F", 0, 1, 0, 1), Interval("B", 0, 1, 1, 2)], origin=101.0)
    timeline = Timeline("gpipe", 2, 1, 1, [[first], [last]])
    assert timeline.bubbles() == [0.5, 0.5] == [timeline.theory] * 2
    assert last.bubble == 0.0  # its own span shows none
    unaligned = Timeline("gpipe", 2, 1, 1, [[first], [replace(last, origin=0.0)]])
    assert unaligned.bubbles() == [0.5, 0.0]  # old files without origins: own spans
