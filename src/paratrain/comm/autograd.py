"""Megatron's paired communication operators, as autograd functions.

Tensor parallelism needs a collective wherever a replicated activation meets a sharded
weight or a partial result must become whole again; every such collective has a
*conjugate* in backward (Shoeybi et al. 2019, "f" and "g"; Korthikanti et al. 2022 for the
sequence-parallel pair):

=============================  ==========================  ==========================
operator                       forward                     backward
=============================  ==========================  ==========================
copy_to_tp_region (f)          identity                    all-reduce
reduce_from_tp_region (g)      all-reduce                  identity
scatter_to_sequence_region     keep own sequence chunk     all-gather along sequence
gather_from_sequence_region    all-gather along sequence   reduce-scatter along sequence
reduce_scatter_to_sequence_    reduce-scatter along seq.   all-gather along sequence
region
=============================  ==========================  ==========================

Activations are (batch, seq, hidden); the sequence is dim 1. The collectives in
``collectives.py`` work on dim 0, so the sequence operators move dim 1 to the front,
communicate contiguous memory, and move it back. Each operator takes its tensor-parallel
group explicitly; a group of one rank makes every operator an identity.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from . import collectives as C

SEQ_DIM = 1


# ---- the collectives along the sequence, and launched-not-awaited variants ----------------
# (The fused region entry in parallel/sequence.py overlaps them with weight gradients.)

def start_all_reduce(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, Any]:
    """Launch the sum of ``x`` over ``group`` into a new tensor; returns (result, handle):
    wait on the handle before reading the result."""
    out = x.contiguous().clone() if C.size(group) > 1 else x
    return out, C.all_reduce(out, group, async_op=True)


def gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, s/t, h) on each rank -> (b, s, h), rank i's chunk at position i."""
    t = C.size(group)
    if t == 1:
        return x
    front = x.transpose(0, SEQ_DIM).contiguous()
    out = front.new_empty((front.shape[0] * t, *front.shape[1:]))
    C.all_gather(out, front, group)
    return out.transpose(0, SEQ_DIM)


def start_reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, Any]:
    """Launch the reduce-scatter along the sequence: (b, s, h) partial sums on each rank ->
    (b, s/t, h) of the full sum, chunk i on rank i. Returns (result, handle)."""
    t = C.size(group)
    if t == 1:
        return x, C.all_reduce(x, group, async_op=True)  # a no-op handle
    _check_divisible(x.shape[SEQ_DIM], t)
    front = x.transpose(0, SEQ_DIM).contiguous()
    out = front.new_empty((front.shape[0] // t, *front.shape[1:]))
    return out.transpose(0, SEQ_DIM), C.reduce_scatter(out, front, group, async_op=True)


def _finish(started: tuple[torch.Tensor, Any]) -> torch.Tensor:
    out, work = started
    work.wait()
    return out


def split_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's chunk of the sequence (no communication)."""
    t = C.size(group)
    if t == 1:
        return x
    _check_divisible(x.shape[SEQ_DIM], t)
    return x.chunk(t, dim=SEQ_DIM)[C.rank(group)].contiguous()


def _check_divisible(seq: int, t: int) -> None:
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by the tensor-parallel size {t}; "
                         f"sequence parallelism shards the sequence evenly: use a sequence length "
                         f"that is a multiple of {t}, or turn sequence parallelism off")


class CopyToTPRegion(torch.autograd.Function):
    """f: enter a tensor-parallel region with a replicated activation.

    Forward: identity (every rank already holds the full input).
    Backward: all-reduce, because each rank's sharded weights produced only a partial
    gradient of the input.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _finish(start_all_reduce(grad, ctx.group)), None


class ReduceFromTPRegion(torch.autograd.Function):
    """g: leave a tensor-parallel region whose ranks hold partial sums.

    Forward: all-reduce, so every rank holds the full output.
    Backward: identity (the output's gradient is already replicated).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _finish(start_all_reduce(x, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ScatterToSequenceRegion(torch.autograd.Function):
    """Split a replicated (b, s, h) activation into sequence shards.

    Forward: keep this rank's chunk of the sequence, no communication.
    Backward: all-gather the chunks' gradients into the full sequence.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return split_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_seq(grad, ctx.group), None


class GatherFromSequenceRegion(torch.autograd.Function):
    """g-bar in Megatron-SP: sequence shards in, full sequence out, before a
    column-parallel layer.

    Forward: all-gather along the sequence.
    Backward: reduce-scatter along the sequence: the column-parallel layer after it gives
    each rank a partial gradient of the whole sequence; each rank keeps the sum for its
    own chunk.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _finish(start_reduce_scatter_seq(grad, ctx.group)), None


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """g in Megatron-SP: partial sums of the full sequence in, summed sequence shards out,
    after a row-parallel layer (replaces the all-reduce of plain tensor parallelism).

    Forward: reduce-scatter along the sequence.
    Backward: all-gather along the sequence.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _finish(start_reduce_scatter_seq(x, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_seq(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromTPRegion.apply(x, group)


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keep own sequence chunk forward, all-gather backward."""
    return ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward."""
    return GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward."""
    return ReduceScatterToSequenceRegion.apply(x, group)


class AllToAllV(torch.autograd.Function):
    """Rows to other ranks in parts of given sizes (``C.all_to_all_v``); backward sends
    each row's gradient back where the row came from (the splits swapped)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup, watch_label: str) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        ctx.watch_label = watch_label  # a hang in backward names the layer (watchdog.py)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        C.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        C.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None, None


def all_to_all_v(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: ProcessGroup, watch_label: str = "") -> torch.Tensor:
    """``watch_label``: what the watchdog calls a hang in it (forward or backward)."""
    return AllToAllV.apply(x, out_splits, in_splits, group, watch_label)
