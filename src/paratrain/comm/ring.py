"""Ring all-reduce, reduce-scatter and all-gather, written on point-to-point send/recv.

These are the textbook bandwidth-optimal algorithms (Patarasuk & Yuan 2009; the ring in
NCCL and Horovod), kept here so they can be read, tested against the backend's native
collectives, and timed next to them by ``paratrain bench comm``.

The p ranks of ``group`` stand in a ring: position r sends to ``r + 1`` and receives from
``r - 1`` (mod p). Every step each rank sends one chunk and receives one, posted together
through ``collectives.send_recv`` so no pair of ranks can deadlock on who sends first.

Chunk convention (shared by all three functions and by ``torch.tensor_split``): the
flattened tensor of n elements is cut into p contiguous chunks with
``flat.tensor_split(p)``; the first ``n % p`` chunks hold one element more than the
others, and chunk i belongs to group position i. ``chunk_sizes(n, p)`` lists the sizes,
so every rank knows every chunk's size without asking. n need not divide by p, and
chunks may be empty (n < p).

* reduce-scatter (p - 1 steps): a partial sum of each chunk travels once around the ring,
  each rank adding its own contribution; rank i ends holding the full reduction of
  chunk i.
* all-gather (p - 1 steps): each finished chunk travels around the ring, each rank
  keeping a copy.
* all-reduce = reduce-scatter then all-gather: every rank sends 2(p - 1)/p of the tensor
  in 2(p - 1) steps, whatever p is (see ``cost.all_reduce_time``).

Ranks in this module are positions within ``group``, as everywhere in ``paratrain.comm``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed import ProcessGroup

from . import collectives as C

# How a received chunk is combined with the local one: (local, incoming, out) -> None.
# "avg" reduces with sum and divides once at the end.
_REDUCE: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "sum": lambda a, b, out: torch.add(a, b, out=out),
    "avg": lambda a, b, out: torch.add(a, b, out=out),
    "max": lambda a, b, out: torch.maximum(a, b, out=out),
    "min": lambda a, b, out: torch.minimum(a, b, out=out),
}


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` chunks ``torch.tensor_split`` cuts ``numel`` elements into:
    the first ``numel % parts`` chunks get one element more."""
    base, extra = divmod(numel, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def ring_all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum") -> None:
    """Reduce ``tensor`` across ``group`` in place, with a ring (any shape, any numel).

    Equal to ``torch.distributed.all_reduce`` up to floating-point summation order.
    ``op`` is one of sum, avg (floating-point tensors only), max, min.
    """
    _check_op(op, tensor)
    p = C.size(group)
    if p == 1 or tensor.numel() == 0:
        return
    # Work on a contiguous buffer: send/recv need contiguous memory and the chunks must be
    # views of it. A non-contiguous tensor gets the result copied back at the end.
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = list(work.view(-1).tensor_split(p))
    mine = chunks[C.rank(group)]
    _reduce_scatter(chunks, mine, group, op)  # our chunk of the result lands in place
    _all_gather(chunks, group)
    if work is not tensor:
        tensor.copy_(work)


def ring_reduce_scatter(input: torch.Tensor, group: ProcessGroup, op: str = "sum",
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``input`` across ``group``; return this rank's chunk of the result, 1-D.

    Position i receives chunk i of the flattened, reduced tensor (the module's chunk
    convention), so ``input.numel()`` need not divide by the group size. When dim 0 does
    divide evenly, ``result.view(-1, *input.shape[1:])`` is the dim-0 slice that
    ``torch.distributed.reduce_scatter_tensor`` would return. ``input`` is left unchanged.
    ``out``, if given, must be contiguous with ``chunk_sizes(input.numel(), p)[rank]``
    elements and is filled and returned instead of a new tensor.
    """
    _check_op(op, input)
    p, r = C.size(group), C.rank(group)
    want = chunk_sizes(input.numel(), p)[r]
    if out is None:
        out = input.new_empty(want)
    _check_out(out, input)
    if out.numel() != want:
        raise ValueError(f"out has {out.numel()} elements but rank {r}'s chunk of "
                         f"{input.numel()} elements over {p} ranks has {want}")
    if p == 1:
        out.view(-1).copy_(input.reshape(-1))
        return out
    chunks = list(input.reshape(-1).tensor_split(p))
    if input.numel() > 0:  # a rank whose own chunk is empty still forwards the others'
        _reduce_scatter(chunks, out.view(-1), group, op)
    return out


def ring_all_gather(chunk: torch.Tensor, group: ProcessGroup,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather every rank's ``chunk`` around the ring; chunk i comes from position i.

    Without ``out`` every rank must pass the same number of elements and the result is a
    new 1-D tensor of ``p * chunk.numel()`` elements. With ``out`` (contiguous, any shape)
    the chunks may be uneven: ``out.numel()`` fixes the total and ``chunk`` must have
    ``chunk_sizes(out.numel(), p)[rank]`` elements, the inverse of ``ring_reduce_scatter``.
    Returns ``out``.
    """
    p, r = C.size(group), C.rank(group)
    if out is None:
        out = chunk.new_empty(p * chunk.numel())
    _check_out(out, chunk)
    flat = out.view(-1)
    chunks = list(flat.tensor_split(p))
    if chunks[r].numel() != chunk.numel():
        raise ValueError(
            f"rank {r}'s chunk has {chunk.numel()} elements, but {flat.numel()} elements "
            f"split over {p} ranks give it {chunks[r].numel()} (torch.tensor_split order: "
            f"the first numel % p chunks are one longer)"
        )
    chunks[r].copy_(chunk.reshape(-1))
    if p > 1 and flat.numel() > 0:
        _all_gather(chunks, group)
    return out


# ---- the two ring phases --------------------------------------------------------------


def _reduce_scatter(chunks: list[torch.Tensor], out: torch.Tensor, group: ProcessGroup,
                    op: str) -> None:
    """Reduce-scatter phase: ``out`` receives the reduction of ``chunks[rank]`` over the
    group. ``chunks`` are not modified (unless ``out`` is ``chunks[rank]`` itself).

    At step s position r sends the partial result of chunk r - s - 1 and receives the
    partial result of chunk r - s - 2 from its left neighbour, adds its own contribution
    and sends that on at step s + 1. After p - 1 steps the chunk that arrives, r - p = r,
    has passed through every rank: it is complete.
    """
    p, r = C.size(group), C.rank(group)
    right, left = (r + 1) % p, (r - 1) % p
    biggest = max(c.numel() for c in chunks)
    # Two scratch chunks, not a copy of the whole tensor: what arrives, and what goes out
    # next. The partial sum may only overwrite the send buffer once that send completed.
    incoming = chunks[0].new_empty(biggest)
    partial = chunks[0].new_empty(biggest)
    outgoing = chunks[(r - 1) % p]  # step 0 sends our own contribution, untouched
    for step in range(p - 1):
        k = (r - step - 2) % p  # the chunk arriving this step
        received = incoming[: chunks[k].numel()]
        _exchange(outgoing, right, received, left, group)
        target = out if k == r else partial[: chunks[k].numel()]
        _REDUCE[op](chunks[k], received, target)
        outgoing = target
    if op == "avg":
        out.div_(p)


def _all_gather(chunks: list[torch.Tensor], group: ProcessGroup) -> None:
    """All-gather phase, in place: ``chunks[rank]`` is filled; afterwards every chunk is.

    At step s position r forwards chunk r - s (its own at step 0, then the one it just
    received) and receives chunk r - s - 1 straight into its place: no scratch memory.
    """
    p, r = C.size(group), C.rank(group)
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        _exchange(chunks[(r - step) % p], right, chunks[(r - step - 1) % p], left, group)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              group: ProcessGroup) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``; wait for both.

    Empty chunks (numel < p) are skipped. Both ends skip alike: the sender's chunk
    index and the receiver's are the same chunk, and every rank knows its size.
    """
    ops = []
    if send.numel() > 0:
        ops.append(C.P2P("send", send, dst))
    if recv.numel() > 0:
        ops.append(C.P2P("recv", recv, src))
    C.wait_all(C.send_recv(ops, group))


# ---- argument checks ------------------------------------------------------------------


def _check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in _REDUCE:
        raise ValueError(f"reduce op {op!r} is not one of {sorted(_REDUCE)}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; "
                        f"use op='sum' and divide")


def _check_out(out: torch.Tensor, like: torch.Tensor) -> None:
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: chunks are received into views of it")
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out is {out.dtype} on {out.device}, the input is "
                         f"{like.dtype} on {like.device}")
