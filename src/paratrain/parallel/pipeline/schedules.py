"""Pipeline schedules as data: each rank's ordered list of actions.

A pipeline of ``p`` ranks holds ``p * v`` virtual stages (``v`` chunks per rank). Following
Megatron, chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``, so every chunk boundary
is a hop to the next rank and the last virtual stage sits on the last rank.

``schedule(kind, stages, microbatches, chunks)`` returns, for every rank, the actions it
runs in order: ``F``/``B`` (forward/backward of a microbatch on a virtual stage), ``W``
(the zero-bubble schedules' deferred weight gradients: a table holding ``1W3`` runs
``1B3`` as the input gradient only, and ``1W3`` later as the weight gradients; a ``B``
without its ``W`` is the whole backward) and the
transfers they imply: ``SEND_F``/``RECV_F`` carry activations to the next stage,
``SEND_B``/``RECV_B`` carry gradients to the previous one. A run of consecutive transfers
is one *batch*, posted at once without blocking; a batch completes only when every peer
has posted the matching transfers, and a computation waits for the batch carrying its
input. Sends and receives between two ranks match in the order they are posted (as in
gloo and NCCL), and the tables are built so that order agrees on both sides.

* **GPipe**: every forward, then every backward. Stage s holds all m microbatches.
* **1F1B**: stage s warms up with p - s - 1 forwards, then alternates one forward and one
  backward, then drains the remaining backwards: at most p - s microbatches in flight.
* **Interleaved 1F1B** (Megatron): 1F1B over chunk-sized work units, microbatches taken in
  groups of p per chunk; the bubble shrinks by v for v times as many transfers.
* **ZB-H1, ZBV, DualPipeV**: the zero-bubble family (``zero_bubble.py``). ZBV and
  DualPipeV place two chunks per rank in a V (``placement``): rank r holds stages r and
  2p - 1 - r, so the first and last stage share rank 0.

``simulator.simulate(tables)`` executes the tables with given costs; ``peak_inflight``
gives the activation memory of a schedule from its compute order alone. Pure Python: no
torch.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass

from ... import rules
from ...layout import LayoutError
from . import zero_bubble
from .timeline import theoretical_bubble

KINDS = ("gpipe", "1f1b", "interleaved", *zero_bubble.KINDS)
COMPUTE = ("F", "B", "W")
TRANSFERS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION_TEXT = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:([<>])(\d+))?")


class ScheduleError(LayoutError):
    """A schedule that cannot run (bad sizes, unmatched transfers, deadlock); the message
    names the problem and the fix."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule."""

    kind: str
    """F, B or W (compute), or SEND_F, RECV_F, SEND_B, RECV_B (transfers)."""
    microbatch: int
    """Which microbatch."""
    stage: int
    """The virtual stage on *this* rank the action serves: the one computed (F, B), whose
    output is sent (SEND_F), whose input is received (RECV_F), whose input gradient is
    sent (SEND_B) or whose output gradient is received (RECV_B); W: whose weight
    gradients are computed."""
    peer: int = -1
    """Pipeline rank at the other end of a transfer; -1 for compute."""

    @property
    def is_transfer(self) -> bool:
        return self.kind in TRANSFERS

    def __str__(self) -> str:
        """Text form, ``{stage}{kind}{microbatch}`` as torch's pipelining writes it (``1F3``:
        stage 1's forward of microbatch 3), a transfer with its peer (``0SEND_F3>1``,
        ``1RECV_F3<0``). ``Action.parse`` reads it back."""
        peer = ""
        if self.is_transfer:
            peer = f">{self.peer}" if self.kind.startswith("SEND") else f"<{self.peer}"
        return f"{self.stage}{self.kind}{self.microbatch}{peer}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action whose text form (``str``) is ``text``."""
        match = _ACTION_TEXT.fullmatch(text.strip())
        if match is None:
            raise ScheduleError(f"{text!r} is not an action: write STAGE KIND MICROBATCH, e.g. "
                                f"'1F3', '0B2', '0SEND_F3>1' or '1RECV_F3<0'")
        stage, kind, mb, arrow, peer = match.groups()
        if (arrow is None) == (kind in TRANSFERS) or (arrow and arrow != ("<" if "RECV" in kind else ">")):
            raise ScheduleError(f"{text!r}: a transfer names its peer (SEND_F3>1, RECV_F3<0), "
                                f"a computation does not")
        return cls(kind, int(mb), int(stage), int(peer) if peer else -1)


def dump_tables(tables: list[list[Action]]) -> str:
    """Tables as CSV text: one line per rank, one action per cell."""
    return "".join(",".join(str(a) for a in actions) + "\n" for actions in tables)


def load_tables(text: str) -> list[list[Action]]:
    """Tables from ``dump_tables``'s CSV text (blank lines and spaces ignored)."""
    return [[Action.parse(cell) for cell in line.split(",") if cell.strip()]
            for line in text.strip().splitlines() if line.strip()]


def owner(stage: int, stages: int) -> int:
    """Pipeline rank holding virtual ``stage`` (Megatron's loop placement)."""
    return stage % stages


def local_chunk(stage: int, stages: int) -> int:
    """Index of virtual ``stage`` among its rank's chunks."""
    return stage // stages


def placement(kind: str) -> str:
    """"v" for the schedules whose two chunks per rank form a V (ZBV, DualPipeV), else
    "loop" (chunk c of rank r is stage c * pp + r)."""
    return "v" if kind in zero_bubble.V_SHAPED else "loop"


def homes(stages: int, chunks: int, shape: str = "loop") -> list[int]:
    """The rank holding each virtual stage: a loop (stage s on s % pp) or a V (stages r
    and 2pp - 1 - r on rank r: down the ranks and back up)."""
    if shape == "v":
        return zero_bubble.v_homes(stages)
    return [owner(s, stages) for s in range(stages * chunks)]


def rank_stages(rank: int, stages: int, chunks: int, shape: str = "loop") -> list[int]:
    """The virtual stages of ``rank``, in local chunk order (ascending)."""
    return [s for s, r in enumerate(homes(stages, chunks, shape)) if r == rank]


# ---- validation ----------------------------------------------------------------------------


def check(kind: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raise ``ScheduleError`` naming the fix unless the schedule can be built."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule {kind!r}; pick one of {', '.join(KINDS)}")
    for name, value in (("stages (pp)", stages), ("microbatches", microbatches),
                        ("chunks (virtual stages)", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be a positive integer")
    problem = zero_bubble.problem(kind, stages, microbatches, chunks)
    if problem:
        raise ScheduleError(problem)
    if kind in ("gpipe", "1f1b", "zbh1") and chunks != 1:
        raise ScheduleError(f"{kind} runs one chunk per rank but virtual_stages={chunks}; use "
                            f"--schedule interleaved or --virtual-stages 1")
    if kind == "interleaved":
        if chunks < 2:
            raise ScheduleError("interleaved 1F1B needs --virtual-stages >= 2 (with one chunk "
                                "per rank it is plain 1F1B: use --schedule 1f1b)")
        try:
            rules.interleaved_microbatches(microbatches, stages)
        except LayoutError as exc:
            raise ScheduleError(str(exc)) from None


def notes(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[str]:
    """Advice on a valid but wasteful configuration (printed by ``paratrain trace``)."""
    out = []
    if stages > 1 and microbatches < stages:
        bubble = theoretical_bubble(stages, microbatches, chunks)
        out.append(f"microbatches={microbatches} < pp={stages}: the pipeline never fills; every "
                   f"rank idles {bubble:.0%} of the step (1F1B degenerates to GPipe). Use at "
                   f"least {stages}, ideally {4 * stages}, microbatches.")
    return out


# ---- tables --------------------------------------------------------------------------------


def schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Each pipeline rank's ordered actions, transfers included."""
    check(kind, stages, microbatches, chunks)
    order = _ORDERS[kind]
    return place_transfers([order(stages, microbatches, chunks, r) for r in range(stages)],
                           stages, chunks, homes(stages, chunks, placement(kind)))


def forward_schedule(stages: int, microbatches: int, chunks: int = 1,
                     shape: str = "loop") -> list[list[Action]]:
    """Each rank's actions for a forward-only pass (evaluation): every microbatch through
    its first chunk, then its second, ..., with the activation transfers; no backward.
    ``shape`` is the training schedule's ``placement``."""
    check("gpipe", stages, microbatches)  # any sizes work without backward
    if not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"chunks (virtual stages)={chunks!r} must be a positive integer")
    where = homes(stages, chunks, shape)
    orders = [[("F", mb, s) for s in rank_stages(r, stages, chunks, shape)
               for mb in range(microbatches)] for r in range(stages)]
    return place_transfers(orders, stages, chunks, where)


def peak_inflight(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[float]:
    """Peak in-flight microbatches of each rank (forwarded, not yet backwarded; a chunk
    counts 1/chunks), from the compute order alone: the same numbers as
    ``simulate(...).peak_inflight`` in a fraction of the time (for the planner)."""
    check(kind, stages, microbatches, chunks)
    order = _ORDERS[kind]
    peaks = []
    for r in range(stages):
        alive = peak = 0
        for step in _alive_steps(order(stages, microbatches, chunks, r)):
            alive += step
            peak = max(peak, alive)
        peaks.append(peak / chunks)
    return peaks


def _alive_steps(order: list["Work"]) -> list[int]:
    """+1 at a forward, -1 where its activations go: at W when split, else at B (a
    split B keeps what the weight gradients need)."""
    split = {(mb, s) for kind, mb, s in order if kind == "W"}
    return [1 if kind == "F" else -1 if kind == "W" or (mb, s) not in split else 0
            for kind, mb, s in order]


def inflight_at_first_backwards(kind: str, stages: int, microbatches: int,
                                chunks: int = 1) -> list[tuple[float, ...]]:
    """For each rank, the in-flight microbatches (as ``peak_inflight`` counts them) at the
    first backward of each of its chunks, in the order those backwards run.

    A gradient accumulated through the step (ZeRO-2/3 under a pipeline) is allocated by
    its chunk's first backward, while activations are freed by every backward: the
    memory peak is the largest of these moments, activations plus the gradients of the
    chunks reached so far. Under interleaving with few microbatches per chunk the first
    backward comes after every forward, and later chunks' gradients appear only as
    activations drain."""
    check(kind, stages, microbatches, chunks)
    out = []
    for r in range(stages):
        alive, seen, moments = 0, set(), []
        order = _ORDERS[kind](stages, microbatches, chunks, r)
        for (step, _, stage), change in zip(order, _alive_steps(order)):
            if step != "F" and stage not in seen:  # a chunk's first gradient (W, or whole B)
                if step == "W" or change:
                    seen.add(stage)
                    moments.append(alive / chunks)  # its input's activations are still held
            alive += change
        out.append(tuple(moments))
    return out


Work = tuple[str, int, int]  # (F, B or W, microbatch, virtual stage)


def _gpipe(p: int, m: int, v: int, r: int) -> list[Work]:
    return [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]


def _one_f_one_b(p: int, m: int, v: int, r: int) -> list[Work]:
    warmup = min(p - r - 1, m)
    order = [("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i, r), ("B", i, r)]
    return order + [("B", i, r) for i in range(m - warmup, m)]


def _interleaved(p: int, m: int, v: int, r: int) -> list[Work]:
    total = m * v  # chunk-sized work units per rank

    def unit(k: int, forward: bool) -> tuple[int, int]:
        # Units go p microbatches at a time through chunk 0, 1, ... (backwards: v-1, ...).
        group, pos = divmod(k, p * v)
        chunk = pos // p if forward else v - 1 - pos // p
        return group * p + pos % p, chunk * p + r

    # Megatron's warm-up: enough forwards that the first backward's gradient arrives just
    # as it is needed. (Megatron runs m == p all-forward-then-backward; these tables do
    # not need to: the simulator finds them deadlock-free, and they hold fewer activations.)
    warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
    order = [("F", *unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *unit(warmup + k, True)), ("B", *unit(k, False))]
    return order + [("B", *unit(k, False)) for k in range(total - warmup, total)]


_ORDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved,
           **zero_bubble.ORDERS}


def _needs(kind: str, s: int, last: int) -> int | None:
    """The stage whose result a computation consumes (None: nothing from another stage)."""
    if kind == "F":
        return s - 1 if s > 0 else None
    if kind == "W":  # its own B's kept work, on the same rank
        return None
    return s + 1 if s < last else None


def place_transfers(orders: list[list[Work]], p: int, v: int,
                    where: list[int] | None = None) -> list[list[Action]]:
    """Turn each rank's compute order into actions with the transfers it implies.

    Transfers go where a run with unit costs puts them: a send right after the
    computation that produced the tensor, the matching receive in the receiver's first
    gap between computations at or after that moment. Each batch (the transfers between
    two computations) then meets its peers' batches at the same moment, the lock-step
    exchange Megatron's schedules make. A receive placed just before its use instead
    deadlocks the ring of an interleaved pipeline when a rank's batches complete in order
    (NCCL groups on one stream): the simulator finds such cycles for most sizes. Both
    sides of a pair post their transfers in production order, so they match. ``where``
    is the rank of each virtual stage (``homes``; default: the loop).
    """
    last = p * v - 1
    where = where or homes(p, v)
    starts = _unit_cost_starts(orders, p, last)
    done = {(k, mb, s): t + 1 for r in range(p) for (k, mb, s), t in zip(orders[r], starts[r])}
    gaps: list[list[list[tuple[float, Action]]]] = [[[] for _ in range(len(o) + 1)] for o in orders]
    for r, order in enumerate(orders):
        for i, (kind, mb, s) in enumerate(order):
            src = _needs(kind, s, last)
            if src is None or where[src] == r:
                continue
            made = done[("F" if kind == "F" else "B", mb, src)]
            gap = bisect_left(starts[r], made)  # first computation starting at or after it
            kind_r = "RECV_F" if kind == "F" else "RECV_B"
            gaps[r][gap].append((made, Action(kind_r, mb, s, where[src])))
    tables = []
    for r, order in enumerate(orders):
        actions: list[Action] = []
        for i, (kind, mb, s) in enumerate(order):
            actions += [a for _, a in sorted(gaps[r][i], key=lambda x: x[0])]
            actions.append(Action(kind, mb, s))
            dst = s + 1 if kind == "F" else s - 1
            if kind != "W" and 0 <= dst <= last and where[dst] != r:
                actions.append(Action("SEND_F" if kind == "F" else "SEND_B", mb, s, where[dst]))
        actions += [a for _, a in sorted(gaps[r][-1], key=lambda x: x[0])]
        tables.append(actions)
    return tables


def _unit_cost_starts(orders: list[list[Work]], p: int, last: int) -> list[list[int]]:
    """Start time of every computation when each takes one unit and transfers are free."""
    finish: dict[Work, int] = {}
    starts: list[list[int]] = [[] for _ in range(p)]
    clock, pos = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, mb, s = orders[r][pos[r]]
                src = _needs(kind, s, last)
                deps = [(kind, mb, src)] if src is not None else []
                if kind != "F":  # B after its forward, W after its B
                    deps.append(("F" if kind == "B" else "B", mb, s))
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r], *(finish[d] for d in deps)])
                starts[r].append(start)
                clock[r] = finish[(kind, mb, s)] = start + 1
                pos[r] += 1
                progress = True
    if any(pos[r] < len(orders[r]) for r in range(p)):
        raise ScheduleError("the compute orders wait on each other (a backward before its "
                            "forward, or a stage before its input): the schedule is invalid")
    return starts


def check_transfers(tables: list[list[Action]]) -> None:
    """Raise ``ScheduleError`` unless, for every pair of ranks, the n-th send from one is
    the n-th receive of the other (same microbatch, neighbouring stages, same kind).

    Backends match point-to-point messages by order, so a mismatch would hand one
    microbatch's tensor to another (or hang), not fail loudly."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for r, actions in enumerate(tables):
        for a in actions:
            if a.kind.startswith("SEND"):
                sends.setdefault((r, a.peer), []).append(a)
            elif a.kind.startswith("RECV"):
                recvs.setdefault((a.peer, r), []).append(a)
    for channel in sends.keys() | recvs.keys():
        src, dst = channel
        out, inc = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(inc):
            raise ScheduleError(f"rank {src} sends {len(out)} tensors to rank {dst}, which "
                                f"receives {len(inc)}: the tables are inconsistent")
        for n, (s, t) in enumerate(zip(out, inc)):
            step = 1 if s.kind == "SEND_F" else -1
            if (t.kind != "RECV" + s.kind[4:] or t.microbatch != s.microbatch
                    or t.stage != s.stage + step):
                raise ScheduleError(f"transfer {n} from rank {src} to rank {dst} is {s} on the "
                                    f"sender but {t} on the receiver: reorder the tables so "
                                    f"both sides post transfers in the same order")
