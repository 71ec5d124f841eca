"""How the executor posts a rank's table, and the buffers that holds.

The table (``schedules.schedule``) says what each rank does in order; this module says
when its transfers are posted and waited for, which the executor follows and the planner
counts memory from:

* ``batches``: consecutive transfers go as one batch.
* ``posting_order``: on gloo receives go ``receives_ahead`` computations early, each
  alone (``executor`` explains why; NCCL keeps them in place).
* ``sends_before``: the sends a computation waits for with its input. gloo cannot tell
  whether a send completed without waiting for it, and a sent tensor lives until then.
* ``held_buffers``: the receive buffers and sent tensors alive at once.

Pure Python: no torch.
"""

from __future__ import annotations

from .schedules import Action


def batches(actions: list[Action]) -> list[Action | list[Action]]:
    """Group a rank's actions as the executor runs them: compute actions alone, runs of
    consecutive transfers as one list (posted together, completing together)."""
    items: list[Action | list[Action]] = []
    for action in actions:
        if not action.is_transfer:
            items.append(action)
        elif items and isinstance(items[-1], list):
            items[-1].append(action)
        else:
            items.append([action])
    return items


GLOO_RECEIVES_AHEAD = 2
"""How many computations before the table's place the executor posts a receive on gloo
(``executor.run_schedule``); ``held_buffers`` counts the buffers that holds."""


def receives_ahead(backend: str) -> int:
    """The executor's default look-ahead on ``backend``: early on gloo only, where every
    transfer completes on its own (on NCCL an early receive could hold back a send)."""
    return GLOO_RECEIVES_AHEAD if backend == "gloo" else 0


def posting_order(actions: list[Action], ahead: int = 0) -> list[Action | list[Action]]:
    """``batches(actions)`` with every receive posted ``ahead`` computations before the
    table places it (none before the first computation), alone in a batch of its own so
    that the computation needing it waits for nothing else. Receives keep their order,
    which is what matching by order relies on; sends stay where they are."""
    items = batches(actions)
    if ahead == 0:
        return items
    early: dict[int, list[Action]] = {}  # compute ordinal -> receives posted just before it
    kept: dict[int, list[Action]] = {}  # item index -> the batch without its early receives
    ordinal = 0
    for i, item in enumerate(items):
        if not isinstance(item, list):
            ordinal += 1
            continue
        at = max(ordinal - ahead, 0)
        moved = [a for a in item if a.kind.startswith("RECV") and at < ordinal]
        early.setdefault(at, []).extend(moved)
        kept[i] = [a for a in item if a not in moved]
    order: list[Action | list[Action]] = []
    ordinal = 0
    for i, item in enumerate(items):
        if isinstance(item, list):
            if kept[i]:
                order.append(kept[i])
            continue
        order.extend([a] for a in early.get(ordinal, []))
        order.append(item)
        ordinal += 1
    return order


def sends_before(actions: list[Action]) -> dict[Action, int]:
    """For each receive, how many of the table's send batches come before it or share its
    batch: the sends the executor waits for with that receive. Completing batches in
    posting order implies those waits for the table as written, under which it is checked
    deadlock-free; posting receives early only lets the peers' sends complete sooner."""
    counts, sends = {}, 0
    for item in batches(actions):
        if isinstance(item, list):
            sends += any(a.kind.startswith("SEND") for a in item)
            counts.update((a, sends) for a in item if a.kind.startswith("RECV"))
    return counts


def held_buffers(actions: list[Action], ahead: int = 0) -> tuple[int, int]:
    """(receive buffers, sent tensors) a rank holds at most while a computation runs,
    posting as ``posting_order(actions, ahead)`` does. A receive buffer is held from its
    posting until its computation starts; a sent tensor (an output, or an input's
    gradient) until the executor waits for its send, with the first receive whose
    ``sends_before`` covers it (gloo reports a send complete only once waited for)."""
    waits = sends_before(actions)
    inputs = {(a.kind[-1], a.microbatch, a.stage): a for a in actions if a.kind.startswith("RECV")}
    held: set[tuple[str, int, int]] = set()
    sent: list[int] = []  # tensors in each send batch posted, in posting order
    settled = peak_recv = peak_sent = 0
    for item in posting_order(actions, ahead):
        if isinstance(item, list):
            held.update((a.kind[-1], a.microbatch, a.stage) for a in item
                        if a.kind.startswith("RECV"))
            if any(a.kind.startswith("SEND") for a in item):
                sent.append(sum(a.kind.startswith("SEND") for a in item))
            continue
        key = (item.kind, item.microbatch, item.stage)
        peak_recv = max(peak_recv, len(held))
        held.discard(key)
        if key in inputs:
            settled = max(settled, waits[inputs[key]])
        peak_sent = max(peak_sent, sum(sent[settled:]))
    return peak_recv, peak_sent
