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

    @property
    def short(self) -> int:
        return min(self.rows, self.cols)

    @property
    def long(self) -> int:
        return max(self.rows, self.cols)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This matrix inside a flat bucket-sized tensor, as a (short x long) view (to read:
        a transposed view is slow to write into)."""
        m = flat[self.offset:self.offset + self.rows * self.cols].view(self.rows, self.cols)
        return m.t() if self.transposed else m

    def add_product(self, flat: torch.Tensor, p: torch.Tensor, q: torch.Tensor, alpha: float,
                    beta: float = 1.0, out: torch.Tensor | None = None) -> None:
        """matrix = beta * matrix + alpha * P Q^T (in the short x long orientation), written
        in the parameter's own contiguous layout (beta=0 ignores what was there), into
        ``flat`` or, read from ``flat``, into the same place of ``out`` (one pass, no copy)."""
        span = slice(self.offset, self.offset + self.rows * self.cols)
        m = flat[span].view(self.rows, self.cols)
        a, b = (q, p.t()) if self.transposed else (p, q.t())
        if out is None:
            m.addmm_(a, b, beta=beta, alpha=alpha)
        else:
            torch.addmm(m, a, b, beta=beta, alpha=alpha, out=out[span].view(self.rows, self.cols))


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive matrices of the given shapes inside ``flat``."""
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at:at + rows * cols].view(rows, cols))
        at += rows * cols
    return out


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
    """Rank-``rank`` PowerSGD of the matrices in a bucket; other tensors uncompressed.

    It works in place, as torch's powerSGD_hook does: the bucket takes the residual in,
    P and Q are computed straight into the two flat messages (``torch.mm(out=...)``), the
    all-reduced Q is the next step's warm start where it lies, and the average is written
    into the bucket by one ``addmm_`` per matrix in the parameter's own layout."""

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
        # The first message: the small tensors, then every P; the second: every Q.
        n_small = self.small.numel()
        self.first = torch.zeros(n_small + sum(m.short * m.rank for m in self.matrices), device=self.device)
        self.second = torch.zeros(sum(m.long * m.rank for m in self.matrices), device=self.device)
        self.ps = _views(self.first[n_small:], [(m.short, m.rank) for m in self.matrices])
        self.qs = _views(self.second, [(m.long, m.rank) for m in self.matrices])
        self.seed = seed
        self._seed_qs(range(len(self.qs)))

    def _seed_qs(self, which) -> None:
        """Draw the listed Qs afresh from the bucket's seed: identical on every rank."""
        gen = torch.Generator().manual_seed(1000 + self.seed)
        for i, q in enumerate(self.qs):
            fresh = torch.randn(q.shape, generator=gen)
            if i in which:
                q.copy_(fresh)

    def drop_nonfinite(self) -> None:
        """Also restart any Q a non-finite gradient turned NaN (it is the all-reduced Q,
        so every rank sees the same ones and draws the same fresh ones)."""
        super().drop_nonfinite()
        self._seed_qs({i for i, q in enumerate(self.qs) if not torch.isfinite(q).all()})

    def _reduce(self, bucket: torch.Tensor, group: ProcessGroup) -> Pending:
        x = self._with_residual(bucket)
        torch.index_select(x, 0, self.small, out=self.first[:self.small.numel()])
        for m, q, p in zip(self.matrices, self.qs, self.ps):
            torch.mm(m.of(x), q, out=p)  # with the previous step's Q: warm start
        self._sent(all_reduce_bytes(self.first.numel() * 4, C.size(group)))
        work = C.all_reduce(self.first, group, op="sum", async_op=True)
        return Pending(work, lambda: self._finish(bucket, x, group))

    def _finish(self, bucket: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> Pending | None:
        p = C.size(group)
        bases = orthogonalize_all(self.ps)
        for m, b, q in zip(self.matrices, bases, self.qs):
            torch.mm(m.of(x).t(), b, out=q)  # this rank's Q = M^T P
        if self.residual is not None:  # what this rank's projection did not send: M - P Q^T
            for m, b, q in zip(self.matrices, bases, self.qs):  # (the small tensors' stays 0)
                m.add_product(x, b, q, alpha=-1.0, out=self.residual)
        x.index_copy_(0, self.small, self.first[:self.small.numel()].div_(p))
        if not self.matrices:
            return self._write_back(bucket, x)
        self._sent(all_reduce_bytes(self.second.numel() * 4, p))
        work = C.all_reduce(self.second, group, op="sum", async_op=True)

        def decompress() -> None:  # the summed Q stays in self.qs: next step's warm start
            for m, b, q in zip(self.matrices, bases, self.qs):
                m.add_product(x, b, q, alpha=1.0 / p, beta=0.0)
            self._write_back(bucket, x)
        return Pending(work, decompress)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"q{i}": q for i, q in enumerate(self.qs)}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            if name.startswith("q"):
                self.qs[int(name[1:])].copy_(value)
        # In one call: whether the saved start is kept depends on the saved count.
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith("q")})
