"""The zero-bubble schedules as compute orders (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024; DeepSeek-V3's DualPipeV).

A backward splits into ``B``, the input gradient the previous stage waits for, and
``W``, the weight gradients nobody waits for: W's fill what would be bubbles. The orders
here are lists of (kind, microbatch, virtual stage) as ``schedules`` builds its tables
from; a ``B`` with a ``W`` for the same microbatch and stage computes the input gradient
only, a ``B`` without one the whole backward.

* **ZB-H1** (``zbh1``): 1F1B's warm-up, but rank r keeps up to r W's pending and runs the
  oldest when one more would exceed that, the rest after its last B. Its activations
  peak at p microbatches on every rank, 1F1B's first stage's peak, and the bubble falls
  from (p - 1)(F + B + W) to (p - 1)(F + B - W) (the paper's H1).
* **ZBV** (``zbv``): two chunks per rank in a V (rank r holds stages r and 2p - 1 - r),
  the paper's ZB-V order: the chunks' F, B and W interleave so that, with F = B = W,
  there is no bubble in the steady state, at 1F1B's activation memory.
* **DualPipeV** (``dualpipev``): DeepSeek's DualPipe cut in half on the V placement: the
  microbatches enter at rank 0's first chunk and come back through its second, and in
  the middle a rank pairs the forward of one chunk with the backward of the other chunk
  (of another microbatch), which a GPU overlaps with each other's communication. The
  pair is two consecutive actions here (a CPU runs them one after the other). One copy
  of the parameters (the bidirectional DualPipe holds two).

Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque

KINDS = ("zbh1", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")

Work = tuple[str, int, int]


def v_homes(p: int) -> list[int]:
    """The rank of each of the 2p stages of a V: 0, 1, ..., p-1, p-1, ..., 1, 0."""
    return [*range(p), *reversed(range(p))]


def problem(kind: str, p: int, m: int, v: int) -> str | None:
    """Why the zero-bubble schedule ``kind`` cannot run these sizes, with the fix (None:
    it can, or ``kind`` is not one of them)."""
    if kind in V_SHAPED and v != 2:
        return (f"{kind} runs two chunks per rank in a V, but virtual_stages={v}; use "
                f"--virtual-stages 2")
    if kind == "dualpipev" and m < 2 * p:
        return (f"dualpipev needs at least 2 x pp = {2 * p} microbatches (each half of the "
                f"V fills with pp of them), but microbatches={m}; use --microbatches {2 * p} "
                f"or more")
    return None


def zbh1(p: int, m: int, v: int, r: int) -> list[Work]:
    """ZB-H1: 1F1B whose rank r defers up to r weight gradients."""
    warmup = min(p - r - 1, m)
    order: list[Work] = [("F", i, r) for i in range(warmup)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        order.append(("B", i, r))
        pending.append(i)
        if len(pending) > r:  # rank r holds p - r in flight: r more keep the peak at p
            order.append(("W", pending.popleft(), r))

    for i in range(m - warmup):
        order.append(("F", warmup + i, r))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    return order + [("W", i, r) for i in pending]


class _Counts:
    """The next microbatch of each (kind, stage) on one rank, and its pending W's."""

    def __init__(self, m: int):
        self.m, self.next, self.order = m, {}, []
        self.pending: deque[tuple[int, int]] = deque()

    def add(self, kind: str, stage: int, split: bool = True) -> None:
        """The next microbatch's ``kind`` on ``stage`` (B: input gradient only when
        ``split``, its W then pending; else the whole backward)."""
        mb = self.next.get((kind, stage), 0)
        self.next[(kind, stage)] = mb + 1
        self.order.append((kind, mb, stage))
        if kind == "B" and split:
            self.pending.append((mb, stage))

    def weight(self) -> None:
        """The oldest pending W, if any."""
        if self.pending:
            mb, stage = self.pending.popleft()
            self.order.append(("W", mb, stage))

    def done(self, m: int) -> list[Work]:
        """The order, without the padding microbatches (>= m) it was built with."""
        return [w for w in self.order if w[1] < m]


def zbv(p: int, m: int, v: int, r: int) -> list[Work]:
    """ZB-V: the paper's phases for rank r's chunks s0 = r (down) and s1 = 2p-1-r (up).
    Built for at least 2p - 1 microbatches; the extra ones are dropped (they only
    lengthen the gaps they would have filled)."""
    n = max(2 * p - 1, m)
    s0, s1 = r, 2 * p - 1 - r
    c = _Counts(n)
    for _ in range(2 * (p - r) - 1):  # warm-up down the V
        c.add("F", s0)
    for _ in range(r):
        c.add("F", s1), c.add("F", s0)
    for _ in range(p - r):  # the bottom of the V turns around
        c.add("F", s1), c.add("B", s1), c.weight()
    while c.next.get(("F", s1), 0) < c.next.get(("F", s0), 0) or c.next[("F", s0)] < n:
        if c.next[("F", s0)] < n:
            c.add("F", s0)
        c.add("B", s0), c.weight()
        c.add("F", s1), c.add("B", s1), c.weight()
    for _ in range(r):  # cool-down: input gradients first, weights in the gaps
        c.add("B", s0), c.add("B", s1)
    for _ in range(p - r):
        c.add("B", s0), c.weight()
    while c.pending:
        c.weight()
    return c.done(m)


def dualpipev(p: int, m: int, v: int, r: int) -> list[Work]:
    """DualPipeV's eight phases for rank r (chunks s0 = r, s1 = 2p-1-r); a pair is F of
    one chunk then the whole B of the other."""
    s0, s1 = r, 2 * p - 1 - r
    c = _Counts(m)
    for _ in range(2 * (p - r - 1)):  # 1: forwards down the V
        c.add("F", s0)
    for _ in range(r + 1):  # 2: both chunks forward
        c.add("F", s0), c.add("F", s1)
    for _ in range(p - r - 1):  # 3: zero-bubble turn at the bottom
        c.add("B", s1), c.weight(), c.add("F", s1)
    for i in range(m - 2 * p + r + 1):  # 4: the main phase, pairs
        c.add("F", s0), c.add("B", s1, split=False)
        c.add("F", s1), c.add("B", s0, split=False)
    for _ in range(p - r - 1):  # 5
        c.add("B", s1, split=False)
        c.add("F", s1), c.add("B", s0, split=False)
    split = False
    for i in range(r + 1):  # 6: the second half of the backwards defers its W's
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        c.add("B", s1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        c.add("B", s0, split)
    for _ in range(p - r - 1):  # 7
        c.weight()
        c.add("B", s0, split)
    while c.pending:  # 8
        c.weight()
    return c.order


ORDERS = {"zbh1": zbh1, "zbv": zbv, "dualpipev": dualpipev}
