"""Timelines: what each pipeline rank did and when, recorded or simulated.

An ``Interval`` is one stretch of a rank's time: a forward (``F``), backward (``B``) or
deferred weight gradient (``W``, zero-bubble schedules) of one microbatch on one virtual stage, a ``WAIT`` for transfers to complete, or a ``POST``
of a batch of transfers (the cost of starting them; recorded runs only). The
simulator (``simulator.py``) produces them from a table; the executor records them from
a real run through a ``Recorder``. Both are drawn by ``paratrain trace`` and both give the
bubble the same way, as in the papers: the fraction of the pipeline's step time that a rank
does not spend computing. The step time is the makespan, from the first rank's start to
the last rank's end (each recorded step carries its wall-clock origin for this): a rank's
own span would leave out the time it sits idle after its part, before the others finish.

This module does not import torch: the planner and the renderer use it without one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

COMPUTE_KINDS = ("F", "B", "W")


class Interval(NamedTuple):
    """One stretch of one rank's time."""

    kind: str
    """F, B (compute), WAIT (blocked on transfers) or POST (starting a batch of them)."""
    microbatch: int
    """Microbatch the work belongs to (-1 for WAIT and POST)."""
    stage: int
    """Virtual stage (-1 for WAIT and POST)."""
    start: float
    """Start, seconds (or cost units) from the beginning of the step."""
    end: float
    """End, same clock."""


def busy_time(intervals: list[Interval]) -> float:
    """Time spent computing (forwards and backwards)."""
    return sum(i.end - i.start for i in intervals if i.kind in COMPUTE_KINDS)


def bubble_fraction(intervals: list[Interval], span: float) -> float:
    """Idle share of a rank's step: 1 - compute time / step time."""
    return 1.0 - busy_time(intervals) / span if span > 0 else 0.0


def breakdown(intervals: list[Interval], span: float) -> dict[str, float]:
    """Shares of a step: compute, wait (for transfers), post (starting them) and other
    (time in none of them: Python between actions, or the rank not scheduled at all)."""
    shares = {kind: sum(i.end - i.start for i in intervals if i.kind == kind) / span
              for kind in ("F", "B", "W", "WAIT", "POST")} if span > 0 else {}
    compute = shares.get("F", 0.0) + shares.get("B", 0.0) + shares.get("W", 0.0)
    wait, post = shares.get("WAIT", 0.0), shares.get("POST", 0.0)
    return {"compute": compute, "wait": wait, "post": post,
            "other": max(0.0, 1.0 - compute - wait - post)}


def theoretical_bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (v·m + p - 1): GPipe and 1F1B (v = 1) and interleaved 1F1B (v chunks)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


@dataclass
class StepRecord:
    """One rank's intervals during one step."""

    span: float
    """Duration of the step on this rank (from entering the executor to leaving it)."""
    intervals: list[Interval]
    """Computations, waits and posts, relative to the step's start."""
    origin: float = 0.0
    """Wall-clock time (``time.time()``) the step began on this rank; 0: not recorded."""

    @property
    def bubble(self) -> float:
        """Idle share of this rank's own span (the pipeline's is ``step_bubbles``)."""
        return bubble_fraction(self.intervals, self.span)

    def to_dict(self) -> dict:
        return {"span": self.span, "origin": self.origin,
                "intervals": [list(i) for i in self.intervals]}

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        return cls(d["span"], [Interval(*i) for i in d["intervals"]], d.get("origin", 0.0))

    def breakdown(self) -> dict[str, float]:
        return breakdown(self.intervals, self.span)


def on_one_clock(records: list[StepRecord]) -> tuple[list[list[Interval]], float]:
    """One pipeline step's intervals of every rank on a common clock, from the earliest
    rank's start, and the makespan to the latest rank's end (wall-clock origins; on
    several hosts their clocks' agreement bounds the accuracy). Without recorded origins,
    each rank on its own clock and the longest span."""
    if not all(r.origin for r in records):
        return [r.intervals for r in records], max(r.span for r in records)
    start = min(r.origin for r in records)
    lanes = [[i._replace(start=i.start + r.origin - start, end=i.end + r.origin - start)
              for i in r.intervals] for r in records]
    return lanes, max(r.origin + r.span for r in records) - start


def step_bubbles(records: list[StepRecord]) -> list[float]:
    """Each rank's idle share of one pipeline step: 1 - its compute / the makespan
    (``on_one_clock``). Without recorded origins, each rank's own span."""
    if not all(r.origin for r in records):
        return [r.bubble for r in records]
    _, makespan = on_one_clock(records)
    return [bubble_fraction(r.intervals, makespan) for r in records]


@dataclass
class Recorder:
    """Collects one rank's intervals, step by step. Pass it to ``run_schedule``.

    ``sync`` is called before reading the clock; on a GPU pass a device synchronize so the
    clock sees kernels finish, not just their launch (it slows the run a little).
    """

    rank: int = 0
    """This rank's position in the pipeline."""
    sync: Callable[[], None] | None = None
    """Called before every clock reading (e.g. ``torch.cuda.synchronize``), or None."""
    steps: list[StepRecord] = field(default_factory=list)
    """Finished steps."""
    _origin: float = field(default=0.0, init=False, repr=False)
    _current: list[Interval] = field(default_factory=list, init=False, repr=False)
    _wall: float = field(default=0.0, init=False, repr=False)

    def now(self) -> float:
        """Seconds since the current step began."""
        if self.sync is not None:
            self.sync()
        return time.perf_counter() - self._origin

    def begin_step(self) -> None:
        self._current = []
        self._origin = 0.0
        self._origin = self.now()
        self._wall = time.time()

    def add(self, kind: str, microbatch: int, stage: int, start: float, end: float) -> None:
        self._current.append(Interval(kind, microbatch, stage, start, end))

    def end_step(self) -> None:
        self.steps.append(StepRecord(self.now(), self._current, self._wall))
        self._current = []

    def bubbles(self, skip: int = 1) -> list[float]:
        """Measured bubble of each recorded step, leaving out the first ``skip`` (warm-up:
        allocator and first-touch costs) when there are more."""
        steps = self.steps[skip:] if len(self.steps) > skip else self.steps
        return [s.bubble for s in steps]

    def bubble(self, skip: int = 1) -> float:
        """Mean measured bubble over the recorded steps after the first ``skip``."""
        values = self.bubbles(skip)
        return sum(values) / len(values) if values else 0.0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "steps": [s.to_dict() for s in self.steps]}


@dataclass
class Timeline:
    """Every rank's recorded steps, with the schedule they ran: what ``trace --run`` reads."""

    schedule: str
    """gpipe, 1f1b or interleaved."""
    stages: int
    """Pipeline ranks."""
    microbatches: int
    """Microbatches per step."""
    chunks: int
    """Virtual stages per rank."""
    ranks: list[list[StepRecord]]
    """ranks[r][step]: the steps rank r recorded."""

    @classmethod
    def from_recorders(cls, schedule: str, stages: int, microbatches: int, chunks: int,
                       recorders: list[dict]) -> "Timeline":
        """Build from every rank's ``Recorder.to_dict()`` (gathered in any order)."""
        by_rank = sorted(recorders, key=lambda d: d["rank"])
        ranks = [[StepRecord.from_dict(s) for s in d["steps"]] for d in by_rank]
        return cls(schedule, stages, microbatches, chunks, ranks)

    def step(self, index: int = -1) -> list[StepRecord]:
        """One step as seen by every rank."""
        return [steps[index] for steps in self.ranks]

    def bubbles(self, skip: int = 1) -> list[float]:
        """Measured bubble of each rank (``step_bubbles``: against the pipeline's makespan),
        averaged over the steps after the first ``skip``."""
        count = min(len(steps) for steps in self.ranks)
        kept = range(skip, count) if count > skip else range(count)
        per_step = [step_bubbles(self.step(i)) for i in kept]
        return [sum(b[r] for b in per_step) / len(per_step) for r in range(len(self.ranks))]

    def bubble(self, skip: int = 1) -> float:
        """Mean measured bubble over ranks."""
        values = self.bubbles(skip)
        return sum(values) / len(values)

    def breakdown(self, skip: int = 1) -> dict[str, float]:
        """Shares of compute, wait, post and other, averaged over ranks and the steps
        after the first ``skip``."""
        parts = [s.breakdown() for steps in self.ranks
                 for s in (steps[skip:] if len(steps) > skip else steps)]
        return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}

    @property
    def theory(self) -> float:
        return theoretical_bubble(self.stages, self.microbatches, self.chunks)

    def save(self, path: str | Path) -> None:
        data = {"schedule": self.schedule, "stages": self.stages,
                "microbatches": self.microbatches, "chunks": self.chunks,
                "ranks": [[s.to_dict() for s in steps] for steps in self.ranks]}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> "Timeline":
        try:
            data = json.loads(Path(path).read_text())
            ranks = [[StepRecord.from_dict(s) for s in steps] for steps in data["ranks"]]
            return cls(data["schedule"], data["stages"], data["microbatches"], data["chunks"],
                       ranks)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a timeline written by the pipeline executor "
                             f"(Timeline.save): {exc}") from None
