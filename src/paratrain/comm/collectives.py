"""Thin collectives over ``torch.distributed``, each taking its process group explicitly.

Ranks passed to these functions (``src``, ``peer``) are *positions within the group*, not
global ranks, so parallel code never needs to know where its group sits in the world.
A group of one rank makes every collective a no-op (or a copy), with no call into the
backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

# torch 2.13 deprecates the *_tensor names in favour of *_single; 2.11 (our GPU machines)
# may lack the new names. Choose once, here.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}


class _Done:
    """Stands in for a ``Work`` handle when nothing had to be communicated."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return dist.get_world_size(group)


def rank(group: ProcessGroup) -> int:
    """This process's position in ``group``."""
    return dist.get_rank(group)


def global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of position ``group_rank`` in ``group``."""
    return dist.get_global_rank(group, group_rank)


def _op(op: str) -> ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"reduce op {op!r} is not one of {sorted(_OPS)}") from None


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum",
               async_op: bool = False) -> Work | _Done | None:
    """Reduce ``tensor`` in place across ``group`` (op: sum, avg, max, min)."""
    if size(group) == 1:
        return _Done() if async_op else None
    return dist.all_reduce(tensor, op=_op(op), group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
               async_op: bool = False) -> Work | _Done | None:
    """Concatenate every rank's ``input`` along dim 0 into ``output`` (``size`` times larger)."""
    if size(group) == 1:
        output.copy_(input)
        return _Done() if async_op else None
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
                   op: str = "sum", async_op: bool = False) -> Work | _Done | None:
    """Reduce ``input`` across ranks; rank i keeps the i-th of ``size`` equal dim-0 chunks."""
    if size(group) == 1:
        output.copy_(input)
        return _Done() if async_op else None
    return _reduce_scatter_flat(output, input, op=_op(op), group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup,
              async_op: bool = False) -> Work | _Done | None:
    """Copy ``tensor`` from group position ``src`` to every rank of ``group``, in place."""
    if size(group) == 1:
        return _Done() if async_op else None
    return dist.broadcast(tensor, src=global_rank(group, src), group=group, async_op=async_op)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
               async_op: bool = False) -> Work | _Done | None:
    """Rank i sends the j-th dim-0 chunk of ``input`` to rank j, which stores it as its
    i-th chunk of ``output``."""
    if size(group) == 1:
        output.copy_(input)
        return _Done() if async_op else None
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                 input_splits: list[int], group: ProcessGroup) -> None:
    """Rank i sends rows ``input_splits[j]`` of ``input`` (in order) to rank j, which
    stores them as its ``output_splits[i]`` rows from rank i. Parts may be empty; every
    rank calls it, whatever it sends (no rank may skip an empty exchange)."""
    if size(group) == 1:
        output.copy_(input)
        return
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer: send ``tensor`` to, or receive it from, group position
    ``peer``."""

    kind: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    """Tells apart several messages between one pair of ranks in one batch (gloo matches
    by tag; NCCL by posting order, so callers post such messages in tag order on both sides)."""


def send_recv(ops: list[P2P], group: ProcessGroup) -> list[Work]:
    """Post all sends and receives of ``ops`` at once (non-blocking); wait on the result.

    Batching lets a rank send to its right neighbour and receive from its left one in the
    same step without the two ranks deadlocking on ordering.
    """
    if not ops:
        return []
    p2p = []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2P kind must be 'send' or 'recv', not {op.kind!r}")
        fn = dist.isend if op.kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, op.tensor, global_rank(group, op.peer), group, op.tag))
    return dist.batch_isend_irecv(p2p)


def wait_all(works: list) -> None:
    """Wait for every handle in ``works``."""
    for work in works:
        work.wait()
