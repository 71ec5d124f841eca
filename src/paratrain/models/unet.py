"""A small U-Net: a plain 2-D convolutional encoder-decoder, written without any parallelism.

    input ─ block ──────────────────────────────── cat ─ block ─ 1x1 conv ─ output
              └ down ─ block ────────── cat ─ block ─ up ┘
                          └ down ─ block ─ up ┘

A block is two (3x3 convolution, group norm, SiLU); down-sampling is a 2x2 convolution of
stride 2 (doubling the channels), up-sampling a 2x2 transposed convolution of stride 2.
``parallel/domain`` parallelizes it after build by swapping its layers, as
``parallel/tensor`` does the GPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    """Shape of the U-Net."""

    in_channels: int = 1
    """Channels of the input field."""
    out_channels: int = 1
    """Channels of the predicted field."""
    width: int = 16
    """Channels at full resolution; each level down doubles them."""
    levels: int = 2
    """Down-sampling steps (each halves height and width)."""
    kernel: int = 3
    """Odd kernel size of the block convolutions."""
    norm_groups: int = 4
    """Groups of the group norms (must divide ``width``)."""
    padding: Literal["zeros", "circular"] = "zeros"
    """Padding at the image edges: zeros, or circular (a periodic domain)."""

    def __post_init__(self) -> None:
        if self.kernel % 2 == 0 or self.kernel < 1:
            raise ValueError(f"kernel={self.kernel}: block convolutions need an odd kernel")
        if self.width < 1 or self.width % self.norm_groups:
            raise ValueError(f"width={self.width}: the group norms' {self.norm_groups} groups must "
                             f"divide it; use a positive width divisible by {self.norm_groups}")
        if self.padding not in ("zeros", "circular"):
            raise ValueError(f"padding={self.padding!r} is not one of zeros, circular")

    def num_params(self) -> int:
        return sum(p.numel() for p in UNet(self).parameters())


class Block(nn.Module):
    """(conv, group norm, SiLU) twice."""

    def __init__(self, cin: int, cout: int, cfg: UNetConfig):
        super().__init__()
        k = cfg.kernel
        self.conv1 = nn.Conv2d(cin, cout, k, padding=k // 2, padding_mode=cfg.padding)
        self.norm1 = nn.GroupNorm(cfg.norm_groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, k, padding=k // 2, padding_mode=cfg.padding)
        self.norm2 = nn.GroupNorm(cfg.norm_groups, cout)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        return self.act(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """Maps (N, in_channels, H, W) to (N, out_channels, H, W); H and W multiples of 2**levels."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        widths = [cfg.width * 2**level for level in range(cfg.levels + 1)]
        self.inp = Block(cfg.in_channels, widths[0], cfg)
        self.down = nn.ModuleList(nn.Conv2d(c, 2 * c, 2, stride=2) for c in widths[:-1])
        self.enc = nn.ModuleList(Block(c, c, cfg) for c in widths[1:])
        self.up = nn.ModuleList(nn.ConvTranspose2d(2 * c, c, 2, stride=2) for c in widths[:-1])
        self.dec = nn.ModuleList(Block(2 * c, c, cfg) for c in widths[:-1])
        self.head = nn.Conv2d(widths[0], cfg.out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        skips = []
        for down, enc in zip(self.down, self.enc):
            skips.append(h)
            h = enc(down(h))
        for up, dec, skip in reversed(list(zip(self.up, self.dec, skips))):
            h = dec(torch.cat([up(h), skip], dim=1))
        return self.head(h)
