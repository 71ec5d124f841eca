"""Halo exchange: the borders a sharded convolution needs from its neighbours, as autograd.

Each rank of the domain group holds one block of every image, (N, C, h, w) out of
(N, C, H, W), laid out on a ``domh x domw`` grid of ranks. A layer whose output row reads
``lo`` rows above it and ``hi`` rows below it (a 3x3 convolution: 1 and 1) needs, before it
can compute its border rows, the last ``lo`` rows of the rank above and the first ``hi``
rows of the rank below; on a 2-D grid also the corners, from the diagonal neighbours. All
of them are posted in one batch of non-blocking sends and receives, so the caller can
compute the interior while they travel:

=================  ======================================  ==================================
                   forward                                 backward
=================  ======================================  ==================================
HaloExchange       send my borders to the neighbours that  send each halo's gradient back to
                   need them, receive theirs (async)       its owner; add the gradients that
                                                           come back to my borders
=================  ======================================  ==================================

At a true edge of the image there is no neighbour: the halo is zeros (zero padding), or,
with ``circular``, the rank on the opposite edge is the neighbour (periodic padding).
Messages are labelled by the direction their owner sent them in, which tells apart
several messages between one pair of ranks (two ranks in a periodic row are each other's
left *and* right neighbour).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ...comm import collectives as C
from ...layout import DOMAIN_AXES, DOMH, DOMW

Offset = tuple[int, int]
DIRECTIONS: tuple[Offset, ...] = tuple((dh, dw) for dh in (-1, 0, 1) for dw in (-1, 0, 1)
                                       if (dh, dw) != (0, 0))


class DomainError(ValueError):
    """A spatial shape that the domain grid or a layer cannot split; says what to change."""


def shard_sizes(total: int, parts: int) -> list[int]:
    """Rows (or columns) of each shard: as even as possible, the first ones one larger."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def shard_slice(total: int, parts: int, index: int) -> slice:
    """Where shard ``index`` of ``parts`` lies in ``range(total)``."""
    sizes = shard_sizes(total, parts)
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


@dataclass(frozen=True)
class Grid:
    """This rank's place in the domain grid: its coordinate and its neighbours' positions in
    the domain group (from Layout's rank math; see ``from_mesh``)."""

    shape: tuple[int, int]
    """Ranks over (height, width)."""
    coord: tuple[int, int]
    """This rank's (row, column) in the grid."""
    positions: dict[tuple[int, int], int]
    """Position in ``group`` of the rank at every grid coordinate."""
    group: ProcessGroup
    """The domain group: every rank that holds a block of the same images."""

    @classmethod
    def from_mesh(cls, mesh) -> "Grid":
        layout = mesh.layout
        coords = [layout.coords(r) for r in mesh.ranks(DOMAIN_AXES)]  # group order = sorted ranks
        positions = {(c.get("domh", 0), c.get("domw", 0)): i for i, c in enumerate(coords)}
        return cls((layout.domh, layout.domw), (mesh.coord(DOMH), mesh.coord(DOMW)),
                   positions, mesh.group(DOMAIN_AXES))

    def neighbour(self, offset: Offset, circular: bool) -> int | None:
        """Group position of the rank at ``offset`` from this one; across a true edge the
        rank on the opposite edge when ``circular``, else None (zero padding)."""
        where = []
        for axis in (0, 1):
            i = self.coord[axis] + offset[axis]
            if not 0 <= i < self.shape[axis]:
                if not circular:
                    return None
                i %= self.shape[axis]
            where.append(i)
        return self.positions[tuple(where)]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a whole (..., H, W) tensor."""
        H, W = full.shape[-2:]
        return full[..., shard_slice(H, self.shape[0], self.coord[0]),
                    shard_slice(W, self.shape[1], self.coord[1])]


@dataclass(frozen=True)
class Halo:
    """How far a layer reads past its block: ``lo`` rows/columns before it and ``hi`` after,
    along (height, width). Zero along an axis the grid does not split."""

    lo: tuple[int, int]
    hi: tuple[int, int]
    circular: bool = False
    """Periodic padding at the true edges instead of zeros."""


def _extent(offset: int, n: int, near: int, far: int) -> int:
    """Size along one axis of the block at ``offset``: before (``near``), mine, after."""
    return {-1: near, 0: n, 1: far}[offset]


def _recv_shape(shape: torch.Size, d: Offset, halo: Halo) -> tuple[int, ...]:
    n = shape[-2:]
    return (*shape[:-2], *(_extent(d[a], n[a], halo.lo[a], halo.hi[a]) for a in (0, 1)))


def _send_index(shape: torch.Size, d: Offset, halo: Halo) -> tuple[slice, ...]:
    """My border that the neighbour at ``d`` reads: the rank below (d=+1) reads my last
    ``lo`` rows as its top halo, the rank above my first ``hi`` rows."""
    index = []
    for a in (0, 1):
        n = shape[-2 + a]
        index.append({-1: slice(0, halo.hi[a]), 0: slice(0, n), 1: slice(n - halo.lo[a], n)}[d[a]])
    return (..., *index)


def _sends(shape, halo: Halo) -> list[Offset]:
    return [d for d in DIRECTIONS
            if all(_extent(d[a], shape[-2 + a], halo.hi[a], halo.lo[a]) for a in (0, 1))]


def _recvs(shape, halo: Halo) -> list[Offset]:
    return [d for d in DIRECTIONS if all(_recv_shape(shape, d, halo)[-2:])]


def _tag(d: Offset) -> int:
    return DIRECTIONS.index(d)


def _post(ops: list[C.P2P], group: ProcessGroup) -> list:
    # One pair of ranks may exchange several messages: both sides post them in tag order.
    return C.send_recv(sorted(ops, key=lambda op: op.tag), group)


def check_thickness(shape: torch.Size, grid: Grid, halo: Halo) -> None:
    """Refuse a block thinner than the halo its neighbours need from it."""
    for a, name in ((0, "rows"), (1, "columns")):
        need = max(halo.lo[a], halo.hi[a])
        if grid.shape[a] > 1 and shape[-2 + a] < need:
            raise DomainError(
                f"this rank's block is {shape[-2 + a]} {name} but a layer reads {need} {name} "
                f"past it, more than one neighbour holds: use fewer ranks along that axis "
                f"(--domain) or a larger grid")


class HaloExchange(torch.autograd.Function):
    """Forward: post the batched non-blocking exchange of borders; returns the receive
    buffers, which hold the halos once ``pending`` has been waited on. Backward: each halo's
    gradient goes back to the rank it came from and is added to that rank's border."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: Grid, halo: Halo, pending: list) -> tuple[torch.Tensor, ...]:
        ctx.grid, ctx.halo, ctx.shape = grid, halo, x.shape
        ops, blocks = [], []
        for d in _recvs(x.shape, halo):
            peer = grid.neighbour(d, halo.circular)
            block = x.new_zeros(_recv_shape(x.shape, d, halo)) if peer is None else \
                x.new_empty(_recv_shape(x.shape, d, halo))
            if peer is not None:
                ops.append(C.P2P("recv", block, peer, _tag((-d[0], -d[1]))))
            blocks.append(block)
        for d in _sends(x.shape, halo):
            peer = grid.neighbour(d, halo.circular)
            if peer is not None:
                ops.append(C.P2P("send", x[_send_index(x.shape, d, halo)].contiguous(), peer, _tag(d)))
        pending.append((_post(ops, grid.group), ops))  # the ops keep the send buffers alive
        return tuple(blocks)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grid, halo, shape = ctx.grid, ctx.halo, ctx.shape
        ops, back = [], []
        for d, g in zip(_recvs(shape, halo), grads):
            peer = grid.neighbour(d, halo.circular)
            if peer is not None:  # labelled with the direction its owner sent it in
                ops.append(C.P2P("send", g.contiguous(), peer, _tag((-d[0], -d[1]))))
        for d in _sends(shape, halo):
            peer = grid.neighbour(d, halo.circular)
            if peer is not None:
                index = _send_index(shape, d, halo)
                buf = grads[0].new_empty(torch.empty(shape, device="meta")[index].shape)
                ops.append(C.P2P("recv", buf, peer, _tag(d)))
                back.append((index, buf))
        C.wait_all(_post(ops, grid.group))
        grad_x = grads[0].new_zeros(shape)
        for index, buf in back:
            grad_x[index] += buf
        return grad_x, None, None, None


def exchange(x: torch.Tensor, grid: Grid, halo: Halo) -> tuple[dict[Offset, torch.Tensor], list]:
    """Start the halo exchange of ``x``; returns ({offset: block}, pending). ``blocks[(0, 0)]``
    is ``x``; the others are filled once ``wait(pending)`` returns."""
    check_thickness(x.shape, grid, halo)
    pending: list = []
    recvs = _recvs(x.shape, halo)
    blocks = dict(zip(recvs, HaloExchange.apply(x, grid, halo, pending))) if recvs else {}
    blocks[(0, 0)] = x
    return blocks, pending


def wait(pending: list) -> None:
    """Wait for the receives (and sends) of an ``exchange``."""
    for works, _ in pending:
        C.wait_all(works)


def _segments(n: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(offset, start, end) of the before / mine / after blocks along one padded axis."""
    parts = [(-1, 0, lo), (0, lo, lo + n), (1, lo + n, lo + n + hi)]
    return [(d, a, b) for d, a, b in parts if b > a]


def window(blocks: dict[Offset, torch.Tensor], halo: Halo, rows: tuple[int, int],
           cols: tuple[int, int]) -> torch.Tensor:
    """Rows ``rows`` and columns ``cols`` of the halo-padded block (coordinates in the padded
    block, whose row 0 is the first halo row), cut from the pieces without building the
    whole padded block."""
    n = blocks[(0, 0)].shape[-2:]
    strips = []
    for dh, h0, h1 in _segments(n[0], halo.lo[0], halo.hi[0]):
        a, b = max(rows[0], h0), min(rows[1], h1)
        if a >= b:
            continue
        pieces = []
        for dw, w0, w1 in _segments(n[1], halo.lo[1], halo.hi[1]):
            c, e = max(cols[0], w0), min(cols[1], w1)
            if c < e:
                pieces.append(blocks[(dh, dw)][..., a - h0:b - h0, c - w0:e - w0])
        strips.append(torch.cat(pieces, -1) if len(pieces) > 1 else pieces[0])
    return torch.cat(strips, -2) if len(strips) > 1 else strips[0]
