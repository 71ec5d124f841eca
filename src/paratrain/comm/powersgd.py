"""PowerSGD (Vogels et al. 2019): rank-R gradient compression with a warm-started power
iteration and error feedback, for one gradient bucket. See compress.py for the interface.

Per matrix M (this rank's gradient plus residual, rows <= columns), with the Q kept from
the previous step:

    P = M Q            all-reduce (sum) P, together with the uncompressed small tensors
    P = orth(P)        the same orthonormal basis on every rank (P is identical after it)
    Q = M^T P          residual = M - P Q^T (what this rank's projection did not send)
                       all-reduce (sum) Q
    average = P Q^T / p; Q is kept for the next step (warm start)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from . import collectives as C
from .compress import Compressor, Pending, all_reduce_bytes


@dataclass(frozen=True)
class Matrix:
    """Where one compressed parameter sits in the bucket."""

    offset: int
    rows: int
    """The parameter's first dimension."""
    cols: int
    """The product of its other dimensions."""
    rank: int
    """Rank of its approximation (at most min(rows, cols))."""

    @property
    def transposed(self) -> bool:
        """Compress M^T when the rows outnumber the columns: P then spans the smaller side,
        and at full rank P P^T is the identity (exact)."""
        return self.rows > self.cols

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This matrix inside a flat bucket-sized tensor, as a (short x long) view."""
        m = flat[self.offset:self.offset + self.rows * self.cols].view(self.rows, self.cols)
        return m.t() if self.transposed else m


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of P's columns (reduced QR; identical inputs give identical
    bases), for one matrix or a batch of them."""
    return torch.linalg.qr(p).Q


def orthogonalize_all(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``orthogonalize`` each matrix, one batched QR per shape (blocks share shapes)."""
    out: list[torch.Tensor | None] = [None] * len(ps)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(ps):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    for indices in by_shape.values():
        for i, q in zip(indices, orthogonalize(torch.stack([ps[i] for i in indices])).unbind(0)):
            out[i] = q
    return out  # type: ignore[return-value]


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD of the matrices in a bucket; other tensors uncompressed."""

    def __init__(self, numel: int, views: list[tuple[int, torch.Size]], rank: int,
                 error_feedback: bool = True, min_compression: float = 2.0, seed: int = 0,
                 device: torch.device | None = None):
        super().__init__(numel, error_feedback, device)
        self.matrices: list[Matrix] = []
        small: list[torch.Tensor] = []
        for offset, shape in views:
            n = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else n
            cols = n // max(rows, 1)
            r = min(rank, rows, cols)
            # Compress only where it pays: r (rows + cols) numbers instead of rows x cols.
            if len(shape) >= 2 and r * (rows + cols) * min_compression < rows * cols:
                self.matrices.append(Matrix(offset, rows, cols, r))
            else:
                small.append(torch.arange(offset, offset + n))
        self.small = torch.cat(small).to(self.device) if small else torch.zeros(0, dtype=torch.long, device=self.device)
        gen = torch.Generator().manual_seed(1000 + seed)  # identical on every rank
        self.qs = [torch.randn(max(m.rows, m.cols), m.rank, generator=gen).to(self.device)
                   for m in self.matrices]

    def _reduce(self, bucket: torch.Tensor, group: ProcessGroup) -> Pending:
        x = self._with_residual(bucket)
        ps = [m.of(x) @ q for m, q in zip(self.matrices, self.qs)]
        first = torch.cat([x[self.small], *[p.reshape(-1) for p in ps]])
        self._sent(all_reduce_bytes(first.numel() * 4, C.size(group)))
        work = C.all_reduce(first, group, op="sum", async_op=True)
        return Pending(work, lambda: self._finish(bucket, x, first, group))

    def _finish(self, bucket: torch.Tensor, x: torch.Tensor, first: torch.Tensor,
                group: ProcessGroup) -> Pending | None:
        p = C.size(group)
        out = torch.zeros_like(x)
        out[self.small] = first[:self.small.numel()] / p
        sizes = [m.of(x).shape[0] * m.rank for m in self.matrices]
        bases = orthogonalize_all([chunk.view(-1, m.rank) for m, chunk in
                                   zip(self.matrices, first[self.small.numel():].split(sizes))])
        local_qs = [m.of(x).t() @ b for m, b in zip(self.matrices, bases)]
        if self.residual is not None:
            residual = x  # x is this step's private copy: overwrite it in place
            residual[self.small] = 0
            for m, b, q in zip(self.matrices, bases, local_qs):
                m.of(residual).sub_(b @ q.t())
            self.residual.copy_(residual)
        if not self.matrices:
            bucket.copy_(out)
            return None
        second = torch.cat([q.reshape(-1) for q in local_qs])
        self._sent(all_reduce_bytes(second.numel() * 4, p))
        work = C.all_reduce(second, group, op="sum", async_op=True)

        def decompress() -> None:
            for i, (m, b, q) in enumerate(zip(self.matrices, bases, second.split([q.numel() for q in local_qs]))):
                self.qs[i] = q.view(-1, m.rank)
                m.of(out).copy_(b @ self.qs[i].t() / p)
            bucket.copy_(out)
        return Pending(work, decompress)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"q{i}": q for i, q in enumerate(self.qs)}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            if name.startswith("q"):
                self.qs[int(name[1:])].copy_(value)
            else:
                getattr(self, name).copy_(value)
