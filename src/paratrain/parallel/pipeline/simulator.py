"""Simulate pipeline tables: when each computation runs, the bubble, the peak memory.

``simulate(tables, f_cost, b_cost, comm_cost)`` executes the action tables of
``schedules.schedule`` on a model of the machine that follows the executor: a batch of
transfers is posted without blocking the rank, a rank's batches complete in posting
order (like a stream of NCCL groups), a batch completes once every peer batch holding a
matching transfer has started, and a computation waits only for the batch carrying its
input. It checks every dependency on the way (a computation whose input never arrives, a
send before its computation) and raises ``ScheduleError`` on a deadlock. The planner and
``paratrain trace`` use it; pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from functools import lru_cache
from dataclasses import dataclass

from .posting import batches
from .schedules import Action, ScheduleError, check_transfers, schedule
from .timeline import Interval, busy_time


@dataclass
class Simulation:
    """The outcome of executing tables with given costs."""

    intervals: list[list[Interval]]
    """Each rank's computes and waits."""
    makespan: float
    """Time until the last rank finishes."""
    busy: list[float]
    """Compute time of each rank."""
    peak_inflight_chunks: list[int]
    """Most (microbatch, chunk) activations a rank held at once (forwarded, not yet
    backwarded)."""
    chunks: int
    """Chunks per rank."""

    @property
    def bubbles(self) -> list[float]:
        """Idle share of each rank over the makespan."""
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle share of all ranks together: 1 - total compute / (ranks x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    @property
    def peak_inflight(self) -> list[float]:
        """Peak in-flight microbatches per rank, a chunk counting 1/chunks of a microbatch
        (its share of the rank's layers): activation memory in units of one microbatch
        through the rank's whole slice of the model."""
        return [n / self.chunks for n in self.peak_inflight_chunks]


def simulate(tables: list[list[Action]], f_cost: float = 1.0, b_cost: float = 2.0,
             comm_cost: float = 0.0,
             stage_costs: Mapping[tuple[str, int], float] | None = None,
             post_cost: float = 0.0, w_cost: float | None = None) -> Simulation:
    """Run ``tables`` on a model of the machine, the way the executor runs them.

    A forward takes ``f_cost``, a backward ``b_cost``, unless ``stage_costs`` gives the
    cost of ("F" or "B", virtual stage): stages that differ (measured ones, a heavy head).
    A split backward's W takes ``w_cost`` (default: half the backward) and its B the rest.
    Each batch of transfers is posted without blocking; a rank's batches complete one
    after another in posting order (a stream of NCCL groups), each ``comm_cost`` after it
    and every peer batch holding its matching transfers have started. A computation waits for the batch that carries its
    input. Posting a batch occupies its rank for ``post_cost`` (the backend's cost of
    starting transfers, which a CPU backend pays on the rank's own core); the batch starts
    after it. Raises ``ScheduleError`` on a deadlock or a computation whose input never comes.
    """
    check_transfers(tables)
    p = len(tables)
    v = max((a.stage for t in tables for a in t), default=0) // max(p, 1) + 1
    stage_costs = stage_costs or {}
    w_share = (w_cost if w_cost is not None else b_cost / 2) / b_cost if b_cost else 0.5
    split = {(a.microbatch, a.stage) for t in tables for a in t if a.kind == "W"}

    def cost(a: Action) -> float:
        whole = stage_costs.get(("B" if a.kind == "W" else a.kind, a.stage),
                                f_cost if a.kind == "F" else b_cost)
        if a.kind == "W":
            return whole * w_share
        return whole * (1 - w_share) if a.kind == "B" and (a.microbatch, a.stage) in split else whole

    sim = _SimState(p, p * v - 1, cost, comm_cost, [batches(t) for t in tables], post_cost)
    sim.split = split
    sim.home = {a.stage: r for r, t in enumerate(tables) for a in t if a.kind == "F"}
    sim.run()
    return Simulation(sim.intervals, max(sim.finish_times(), default=0.0),
                      [busy_time(iv) for iv in sim.intervals], sim.peak, v)


@dataclass
class _Batch:
    rank: int
    actions: list[Action]
    post: float = -1.0  # when the rank's program reached it (-1: not yet)
    start: float = -1.0  # when it could start: posted and the previous batch done
    done: float = -1.0  # when it completed
    prev: "_Batch | None" = None  # the rank's batch before this one (completes first)
    next: "_Batch | None" = None
    ops: tuple = ()  # (channel, n, is_send) per action


class _SimState:
    """Clocks, positions and batches of every rank, advanced by a worklist."""

    def __init__(self, p: int, last: int, cost: Callable[[Action], float], comm: float, items: list,
                 post_cost: float = 0.0):
        self.p, self.last, self.cost, self.comm, self.items = p, last, cost, comm, items
        self.post_cost = post_cost
        self.pos, self.clock = [0] * p, [0.0] * p
        self.intervals: list[list[Interval]] = [[] for _ in range(p)]
        self.last_batch: list[_Batch | None] = [None] * p
        self.channel: dict[tuple, list[_Batch]] = {}  # (src, dst, is_send) -> batches by n
        self.ready: list[dict[tuple, float]] = [{} for _ in range(p)]  # what each rank holds
        self.waiting: list[dict[tuple, _Batch]] = [{} for _ in range(p)]  # received, when done
        self.inflight, self.peak = [0] * p, [0] * p
        self.work: deque = deque(("rank", r) for r in range(p))
        self.split: set[tuple[int, int]] = set()  # (microbatch, stage) whose backward has a W
        self.home: dict[int, int] = {}  # virtual stage -> rank

    def run(self) -> None:
        while self.work:
            what, obj = self.work.popleft()
            if what == "rank":
                self._advance(obj)
            else:
                self._resolve(obj)
        stuck = [r for r in range(self.p) if self.pos[r] < len(self.items[r])]
        if stuck:
            where = (f"rank {r} is stuck at {self._describe(self.items[r][self.pos[r]])}"
                     for r in stuck)
            raise ScheduleError("the schedule deadlocks: " + "; ".join(where))

    def finish_times(self) -> list[float]:
        return [max(self.clock[r], self.last_batch[r].done if self.last_batch[r] else 0.0)
                for r in range(self.p)]

    def _describe(self, item) -> str:
        return str(item) if isinstance(item, Action) else "[" + ", ".join(map(str, item)) + "]"

    def _advance(self, r: int) -> None:
        """Run rank r's program until a computation waits for a transfer."""
        while self.pos[r] < len(self.items[r]):
            item = self.items[r][self.pos[r]]
            if isinstance(item, Action):
                if not self._compute(r, item):
                    return
            else:
                self._post(r, item)
            self.pos[r] += 1

    def _compute(self, r: int, a: Action) -> bool:
        key, ready = (a.microbatch, a.stage), self.ready[r]
        if a.kind == "F":  # its input, unless it reads tokens
            needs = [] if a.stage == 0 else [("x", *key)]
        elif a.kind == "W":  # the input gradient's pass, which kept the work
            needs = [("B", *key)]
        else:  # its forward, and its output's gradient unless it starts from the loss
            needs = [("F", *key)] + ([] if a.stage == self.last else [("g", *key)])
        for need in needs:
            if need not in ready:
                if need in self.waiting[r]:
                    return False  # its batch has not completed; woken when it does
                raise ScheduleError(f"rank {r}: {a} runs before {need[0]!r} is available "
                                    f"(x: input, g: output gradient, F: its forward)")
        if (a.kind, *key) in ready:
            raise ScheduleError(f"rank {r}: {a} runs twice")
        start = max([self.clock[r], *(ready[n] for n in needs)])
        if start > self.clock[r]:
            self.intervals[r].append(Interval("WAIT", -1, -1, self.clock[r], start))
        self.clock[r] = end = start + self.cost(a)
        self.intervals[r].append(Interval(a.kind, a.microbatch, a.stage, start, end))
        ready[(a.kind, *key)] = end
        # A neighbouring chunk on the same rank gets its tensor in memory, no transfer.
        if a.kind == "F" and a.stage < self.last and self.home.get(a.stage + 1) == r:
            ready[("x", a.microbatch, a.stage + 1)] = end
        if a.kind == "B" and a.stage > 0 and self.home.get(a.stage - 1) == r:
            ready[("g", a.microbatch, a.stage - 1)] = end
        # Activations live from F to the backward computing weight gradients (W if split).
        self.inflight[r] += 1 if a.kind == "F" else 0 if a.kind == "B" and key in self.split else -1
        self.peak[r] = max(self.peak[r], self.inflight[r])
        return True

    def _post(self, r: int, actions: list[Action]) -> None:
        if self.post_cost:
            start, self.clock[r] = self.clock[r], self.clock[r] + self.post_cost
            self.intervals[r].append(Interval("POST", -1, -1, start, self.clock[r]))
        batch = _Batch(r, actions, post=self.clock[r], prev=self.last_batch[r])
        if batch.prev is not None:
            batch.prev.next = batch
        self.last_batch[r] = batch
        ops = []
        for a in actions:
            send = a.kind.startswith("SEND")
            if send and (a.kind[-1], a.microbatch, a.stage) not in self.ready[r]:
                raise ScheduleError(f"rank {r}: {a} is posted before its computation")
            if not send:
                self.waiting[r][("x" if a.kind == "RECV_F" else "g", a.microbatch, a.stage)] = batch
            channel = (r, a.peer) if send else (a.peer, r)
            queue = self.channel.setdefault((*channel, send), [])
            ops.append((channel, len(queue), send))
            queue.append(batch)
        batch.ops = tuple(ops)
        self.work.append(("batch", batch))

    def _partners(self, batch: _Batch) -> list[_Batch | None]:
        out = []
        for channel, n, send in batch.ops:
            queue = self.channel.get((*channel, not send), [])
            out.append(queue[n] if n < len(queue) else None)
        return out

    def _resolve(self, batch: _Batch) -> None:
        """Fix the batch's start and completion once what they depend on is known."""
        if batch.done >= 0:
            return
        if batch.start < 0:
            if batch.prev is not None and batch.prev.done < 0:
                return  # resolved again when the previous batch completes
            batch.start = max(batch.post, batch.prev.done if batch.prev else 0.0)
            for partner in self._partners(batch):
                if partner is not None:
                    self.work.append(("batch", partner))
        partners = self._partners(batch)
        if any(p is None or p.start < 0 for p in partners):
            return  # resolved again when a partner is posted or starts
        batch.done = max([batch.start, *(p.start for p in partners)]) + self.comm
        r = batch.rank
        for a in batch.actions:
            if not a.kind.startswith("SEND"):
                key = ("x" if a.kind == "RECV_F" else "g", a.microbatch, a.stage)
                self.ready[r][key] = batch.done
        self.work.append(("rank", r))
        if batch.next is not None:
            self.work.append(("batch", batch.next))


def idle_microbatches(kind: str, p: int, m: int, v: int = 1, b_over_f: float = 2.0) -> float:
    """A rank's mean idle time per step under ``kind``, in units of one microbatch's work
    on the rank (its forward and backward): p - 1 for GPipe and 1F1B, (p - 1)/v
    interleaved, less for the zero-bubble schedules, whose W (half the backward) fills
    gaps. Simulated from the tables with a backward ``b_over_f`` times the forward.

    The planner asks for thousands of shapes up to p = 128, where one simulation takes
    seconds: past the warm-up the tables repeat and add no idle time, and the idle time
    grows as p - 1 at a given m / p (ZB-H1's (p - 1)(F + B - W)), so a pipeline of more
    than 8 ranks is simulated as 8 ranks with as many microbatches per rank (at most 4),
    its idle time scaled by (p - 1) / 7."""
    if p == 1:
        return 0.0
    small = min(p, 8)
    per_rank = min(m, 4 * p) / p
    m_small = max(round(per_rank * small), 2 * small if kind == "dualpipev" else 1)
    ratio = max(round(b_over_f * 4) / 4, 0.25)  # the many shapes share a few simulations
    return _idle(kind, small, m_small, v, ratio) * (p - 1) / (small - 1)


@lru_cache(maxsize=1 << 12)
def _idle(kind: str, p: int, m: int, v: int, ratio: float) -> float:
    sim = simulate(schedule(kind, p, m, v), 1.0, ratio)
    return (sim.makespan - sum(sim.busy) / p) / (v * (1.0 + ratio))
