"""The layers of a domain-parallel network: each computes its block of the output from its
block of the input, plus whatever crosses the block's edges.

- ``DomainConv2d``: a convolution that reads ``lo`` rows before and ``hi`` rows after its
  block (``lo = padding``, ``hi = kernel - stride - padding``): stride-1 convolutions of any
  odd kernel, and strided down-sampling when every block's size is a multiple of the stride.
  With stride 1 it computes the interior while the halos travel, then the border strips.
- ``DomainGroupNorm``: group norm whose mean and variance (and, in backward, the two sums
  the input gradient needs) are reduced over the domain group.
- ``LocalResample``: pooling with kernel = stride, which never crosses a block edge when
  every block's size is a multiple of the stride.

They keep the plain module's parameters under the same names, so checkpoints and optimizer
states are those of the plain model.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import collectives as C
from .halo import DomainError, Grid, Halo, exchange, wait, window


def conv_halo(kernel: int, stride: int, padding: int) -> tuple[int, int]:
    """(lo, hi) rows a convolution reads before and after its block; refuses convolutions
    whose blocks of output do not line up with blocks of input."""
    lo, hi = padding, kernel - stride - padding
    # Output size (n + 2p - k) // s + 1 must be n / s, or the blocks of output would not
    # tile the plain layer's output.
    if not kernel - stride <= 2 * padding < kernel or hi < 0:
        raise DomainError(f"a convolution with kernel {kernel}, stride {stride} and padding "
                          f"{padding} does not map blocks of input onto blocks of output; "
                          f"use padding (kernel - 1) // 2 with stride 1, or kernel = stride")
    return lo, hi


class DomainConv2d(nn.Module):
    """``nn.Conv2d`` on this rank's block, with halos from its neighbours (see module doc)."""

    def __init__(self, conv: nn.Conv2d, grid: Grid):
        super().__init__()
        if conv.dilation != (1, 1) or isinstance(conv.padding, str):
            raise DomainError("domain-parallel convolutions need dilation 1 and a numeric "
                              "padding (kernel - 1) // 2")
        if conv.padding_mode not in ("zeros", "circular"):
            raise DomainError(f"padding_mode={conv.padding_mode!r}: domain parallelism supports "
                              f"'zeros' and 'circular'")
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.groups, self.grid = conv.stride, conv.groups, grid
        self.circular = conv.padding_mode == "circular"
        self.overlap = True
        """Compute the interior while the halos travel (False: wait first; for measuring)."""
        self.recorder: list | None = None
        """Set to a list to record, per call, the times (launch, interior done, halos in, done)."""
        halos = [conv_halo(k, s, p) for k, s, p in zip(conv.kernel_size, conv.stride, conv.padding)]
        split = [grid.shape[a] > 1 for a in (0, 1)]
        # An axis the grid does not split pads as the plain layer does, locally.
        self.halo = Halo(lo=tuple(h[0] if s else 0 for h, s in zip(halos, split)),
                         hi=tuple(h[1] if s else 0 for h, s in zip(halos, split)),
                         circular=self.circular)
        self.local = tuple((0, 0) if s else h for h, s in zip(halos, split))

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[1] * self.groups}, {self.weight.shape[0]}, kernel="
                f"{tuple(self.weight.shape[2:])}, stride={self.stride}, halo={self.halo}")

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        pad = (0, 0) if self.circular else tuple(lo for lo, _ in self.local)
        return F.conv2d(x, self.weight, self.bias, self.stride, pad, 1, self.groups)

    def _local_pad(self, x: torch.Tensor) -> torch.Tensor:
        """Circular padding along axes the grid does not split (zeros: the conv pads)."""
        (th, bh), (lw, rw) = self.local
        if not self.circular or not (th or bh or lw or rw):
            return x
        return F.pad(x, (lw, rw, th, bh), mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, s in enumerate(self.stride):
            if x.shape[-2 + a] % s:
                raise DomainError(f"stride {s} needs every block's size to be a multiple of "
                                  f"{s}, but this rank's is {x.shape[-2 + a]}: pick a grid size "
                                  f"and --domain that give blocks divisible by the network's "
                                  f"total down-sampling")
        x = self._local_pad(x)
        t0 = time.perf_counter()
        blocks, pending = exchange(x, self.grid, self.halo)
        (lh, lw), (hh, hw) = self.halo.lo, self.halo.hi
        n_h, n_w = x.shape[-2:]
        overlap = self.overlap and self.stride == (1, 1) and n_h > lh + hh and n_w > lw + hw
        interior = self._conv(x) if overlap else None  # needs no halo: runs while they travel
        t1 = time.perf_counter()
        wait(pending)
        t2 = time.perf_counter()
        H, W = lh + n_h + hh, lw + n_w + hw  # the padded block
        if not overlap:
            out = self._conv(window(blocks, self.halo, (0, H), (0, W)))
        else:
            middle = [interior]
            if lw:
                middle.insert(0, self._conv(window(blocks, self.halo, (lh, lh + n_h), (0, 2 * lw + hw))))
            if hw:
                middle.append(self._conv(window(blocks, self.halo, (lh, lh + n_h), (n_w - hw, W))))
            rows = [torch.cat(middle, -1) if len(middle) > 1 else interior]
            if lh:
                rows.insert(0, self._conv(window(blocks, self.halo, (0, 2 * lh + hh), (0, W))))
            if hh:
                rows.append(self._conv(window(blocks, self.halo, (n_h - hh, H), (0, W))))
            out = torch.cat(rows, -2) if len(rows) > 1 else rows[0]
        if self.recorder is not None:
            self.recorder.append((t0, t1, t2, time.perf_counter()))
        return out


class _GroupNormFn(torch.autograd.Function):
    """Group norm over the whole domain: per (sample, group) statistics summed over the
    domain group. Saves only the input and the per-group mean and 1/std, like torch's."""

    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, group) -> torch.Tensor:
        N, Cn = x.shape[:2]
        xg = x.reshape(N, groups, -1)
        # Sums and element counts in one all-reduce (blocks may differ in size).
        stats = torch.cat([xg.sum(-1).flatten(), x.new_full((1,), float(xg.shape[-1]))])
        C.all_reduce(stats, group)
        count = stats[-1:]
        mean = stats[:-1].view(N, groups) / count
        var = (xg - mean[..., None]).pow(2).sum(-1)  # two passes: as accurate as torch's
        C.all_reduce(var, group)
        rstd = torch.rsqrt(var / count + eps)
        ctx.save_for_backward(x, weight, mean, rstd, count)
        ctx.groups, ctx.group = groups, group
        y = ((xg - mean[..., None]) * rstd[..., None]).reshape_as(x)
        return y * weight.view(1, Cn, 1, 1) + bias.view(1, Cn, 1, 1)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd, count = ctx.saved_tensors
        N, Cn = x.shape[:2]
        xhat = ((x.reshape(N, ctx.groups, -1) - mean[..., None]) * rstd[..., None]).reshape_as(x)
        dweight = (dy * xhat).sum((0, 2, 3))
        dbias = dy.sum((0, 2, 3))
        g = (dy * weight.view(1, Cn, 1, 1)).reshape(N, ctx.groups, -1)
        xh = xhat.reshape(N, ctx.groups, -1)
        sums = torch.stack([g.sum(-1), (g * xh).sum(-1)])  # one all-reduce for both
        C.all_reduce(sums, ctx.group)
        sums /= count
        dx = rstd[..., None] * (g - sums[0][..., None] - xh * sums[1][..., None])
        return dx.reshape_as(x), dweight, dbias, None, None, None


class DomainGroupNorm(nn.Module):
    """``nn.GroupNorm`` whose statistics span every block of the image."""

    def __init__(self, norm: nn.GroupNorm, grid: Grid):
        super().__init__()
        if not norm.affine:
            raise DomainError("domain-parallel group norm expects affine=True (the default)")
        self.weight, self.bias = norm.weight, norm.bias
        self.num_groups, self.eps, self.group = norm.num_groups, norm.eps, grid.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GroupNormFn.apply(x, self.weight, self.bias, self.num_groups, self.eps, self.group)


class LocalResample(nn.Module):
    """Pooling with kernel = stride and no padding: local to each block, provided every
    block's size is a multiple of the stride (checked, never silently floored)."""

    def __init__(self, pool: nn.Module, grid: Grid):
        super().__init__()
        k, s, p = pool.kernel_size, pool.stride, pool.padding
        if k != s or p not in (0, (0, 0)):
            raise DomainError(f"{type(pool).__name__}(kernel={k}, stride={s}, padding={p}) "
                              f"would read across block edges; use kernel = stride, padding 0")
        self.pool, self.factor = pool, s if isinstance(s, int) else s[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] % self.factor or x.shape[-1] % self.factor:
            raise DomainError(f"pooling by {self.factor} needs every block's size to be a "
                              f"multiple of {self.factor}; this rank's is {tuple(x.shape[-2:])}")
        return self.pool(x)


def check_upsample(up: nn.ConvTranspose2d, grid: Grid) -> nn.ConvTranspose2d:
    """A transposed convolution with kernel = stride and no padding writes each input pixel
    to its own output pixels: local to each block, kept as it is."""
    if up.kernel_size != up.stride or up.padding != (0, 0) or up.output_padding != (0, 0):
        raise DomainError(f"ConvTranspose2d(kernel={up.kernel_size}, stride={up.stride}, "
                          f"padding={up.padding}) overlaps neighbouring blocks' outputs; "
                          f"use kernel = stride and padding 0 for sharded up-sampling")
    return up
