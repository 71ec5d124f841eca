"""int8 gradient compression with error feedback, for one bucket (see compress.py for the
interface).

int8 cannot overflow: no reduction ever runs on int8 values. Each rank quantizes its
bucket in blocks of ``INT8_BLOCK`` entries, one fp32 scale per block (block-wise, as
QSGD's buckets and 8-bit optimizers do: one scale per large chunk rounds every entry
below 1/254 of the chunk's largest to zero), and an all-to-all hands chunk k (a run of
blocks) of every rank to rank k, which dequantizes and sums them in fp32 (a
reduce-scatter in a wider type, done locally); the owner re-quantizes its averaged chunk
and an all-gather of int8 chunks returns the result to everyone. The re-quantization
error of chunk k goes into rank k's residual (times p, as it is an error of the
average), so the invariant still holds. Each rank sends 2(p-1)/p (1 + 4/INT8_BLOCK)
bytes per entry: 0.254 of an fp32 ring all-reduce.
"""

from __future__ import annotations

import math

import torch

from . import collectives as C
from .compress import Compressor, Pending, all_gather_bytes, all_to_all_bytes


INT8_BLOCK = 256
"""Most entries per int8 scale: 4 bytes of scale per 256 of data (1.6%)."""
SMALLEST_SCALE = 2.0 ** -100
"""The least scale: 1 / scale must stay finite in fp32, which fails for a block whose
largest entry is denormal (an inf there made the residual NaN). A block below 127 times
this quantizes to 0 and keeps its values in the residual; zero blocks stay exact."""


def _quantize(x: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` to int8 in ``out`` (rows x (columns + 4): each row's fp32 scale rides
    in its last four bytes, one message), max |x| mapping to 127. ``scratch`` (x's shape)
    is left holding the rounded values as floats; returns the scales.

    Multiplying by 127 / max |x| keeps every product within ±127 (up to rounding), so no
    clamp is needed. Every pass writes into a buffer the compressor keeps: on CPU a fresh
    bucket-sized tensor costs more than the arithmetic (page faults on first touch)."""
    amax = torch.abs(x, out=scratch).amax(dim=1)
    scale = amax.clamp_(min=SMALLEST_SCALE * 127) / 127
    torch.mul(x, scale.reciprocal()[:, None], out=scratch).round_()
    out[:, :-4].copy_(scratch)
    out[:, -4:].copy_(scale.view(torch.int8).view(-1, 4))
    return scale


def _scales(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of rows packed by ``_quantize``."""
    return packed[:, -4:].contiguous().view(torch.float32).view(-1)


def _dequantize(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Packed int8 rows back to fp32, in ``out`` (their shape less the scale bytes)."""
    return out.copy_(packed[:, :-4]).mul_(_scales(packed)[:, None])


class Int8(Compressor):
    """int8 with a scale per block: all-to-all, fp32 sum, re-quantize, all-gather."""

    def __init__(self, numel: int, error_feedback: bool = True, device: torch.device | None = None):
        super().__init__(numel, error_feedback, device)
        self._shape: tuple[int, int, int] | None = None
        """(group size, blocks per chunk, entries per block) the work buffers are sized for."""

    def _buffers(self, p: int) -> tuple[int, int]:
        """Blocks per chunk and entries per block for a group of ``p``, and (once) the work
        buffers, 10 bytes per entry: the padded fp32 bucket, a float scratch, and the int8
        messages sent and received (the all-gather reuses the all-to-all's)."""
        # Rank k averages chunk k, a run of equal blocks of at most INT8_BLOCK entries
        # (equal sizes keep the padding under one entry per block).
        blocks = math.ceil(math.ceil(self.numel / p) / INT8_BLOCK)
        size = math.ceil(self.numel / (p * blocks))
        if self._shape != (p, blocks, size):
            self._shape = (p, blocks, size)
            rows, dev = p * blocks, self.device
            self._x = torch.zeros(rows, size, device=dev)  # the padding stays 0
            self._scratch = torch.empty(rows, size, device=dev)
            self._send, self._recv = (torch.empty(rows, size + 4, dtype=torch.int8, device=dev)
                                      for _ in range(2))
        return blocks, size

    def drop_nonfinite(self) -> None:
        """Also re-zero the padding of the work buffer: a NaN scale leaves the padding of
        its block NaN, and that block would quantize to NaN at every later step."""
        super().drop_nonfinite()
        if self._shape is not None:
            self._x.view(-1)[self.numel:].zero_()

    def _reduce(self, bucket, group):
        p, n = C.size(group), self.numel
        blocks, size = self._buffers(p)
        x, flat = self._x, self._x.view(-1)
        flat[:n].copy_(bucket.detach())
        if self.residual is not None:
            flat[:n].add_(self.residual)
        scale = _quantize(x, self._scratch, self._send)
        if self.residual is not None:  # what was not sent: x - dequantized
            self.residual.copy_(x.addcmul_(self._scratch, scale[:, None], value=-1).view(-1)[:n])
        self._sent(all_to_all_bytes(self._send.numel(), p))
        work = C.all_to_all(self._recv.view(p, -1), self._send.view(p, -1), group, async_op=True)
        return Pending(work, lambda: self._finish(bucket, group, blocks, size))

    def _finish(self, bucket, group, blocks, size):
        p, me, n = C.size(group), C.rank(group), self.numel
        parts = _dequantize(self._recv, self._scratch).view(p, blocks, size)
        mean = torch.sum(parts, dim=0, out=self._x[:blocks]).div_(p)  # fp32: cannot overflow
        mine = self._send[:blocks]
        scale = _quantize(mean, self._scratch[:blocks], mine)
        if self.residual is not None:  # the error of the average, kept by the chunk's owner
            chunk = blocks * size
            lo, hi = me * chunk, min(n, (me + 1) * chunk)
            if hi > lo:
                error = mean.addcmul_(self._scratch[:blocks], scale[:, None], value=-1).view(-1)
                self.residual[lo:hi].add_(error[:hi - lo], alpha=p)
        self._sent(all_gather_bytes(mine.numel(), p))
        work = C.all_gather(self._recv.view(-1), mine.reshape(-1), group, async_op=True)

        def unpack():
            bucket.copy_(_dequantize(self._recv, self._scratch).view(-1)[:n])
        return Pending(work, unpack)
