"""The heat2d task's settings and data: solutions of the 2-D heat equation, made from a seed.

Each sample is a pair of fields on a ``grid_size x grid_size`` grid: a smooth random
initial temperature u(0) and the temperature u(T) after ``heat_substeps`` explicit steps of

    u <- u + r * (u[i-1,j] + u[i+1,j] + u[i,j-1] + u[i,j+1] - 4 u[i,j]),   r = heat_diffusivity

(the 5-point Laplacian; stable for r <= 1/4), with periodic boundaries (``circular``) or a
zero temperature outside the grid (``zeros``). The model learns u(0) -> u(T). Nothing is
downloaded: the same seed gives the same data on every rank and every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F


@dataclass
class Heat2DConfig:
    """The heat2d task (``--task heat2d``): data and U-Net shape."""

    grid_size: int = 64
    """Height and width of every field (a multiple of the domain grid x 2**unet_levels)."""
    heat_samples: int = 256
    """Samples generated (the last eighth is held out for validation)."""
    heat_diffusivity: float = 0.2
    """r = alpha dt / dx^2 of each explicit step (at most 0.25)."""
    heat_substeps: int = 20
    """Explicit steps between the input and the target field."""
    boundary: Literal["zeros", "circular"] = "circular"
    """circular: a periodic domain; zeros: zero temperature outside. Also the U-Net's padding."""
    unet_width: int = 16
    """U-Net channels at full resolution."""
    unet_levels: int = 2
    """U-Net down-sampling steps."""
    unet_kernel: int = 3
    """Odd kernel size of the U-Net's convolutions."""


SECTION = Heat2DConfig
"""The run config's ``[heat2d]`` table (``task.task_sections``)."""
SECTION_TITLE = "heat2d (read only with --task heat2d: the U-Net and its generated fields)"
"""Its title in ``train --help``."""


@dataclass
class Fields:
    """Input and target fields, (samples, 1, G, G) each."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]


def initial_fields(n: int, size: int, boundary: str, seed: int) -> torch.Tensor:
    """Smooth random fields: a few low-frequency modes with random amplitudes (periodic
    cosines, or sines that vanish at the edges)."""
    g = torch.Generator().manual_seed(seed)
    modes = 4
    amp = torch.randn(n, modes, modes, generator=g) / (1 + torch.arange(modes) ** 2)
    phase = torch.rand(n, modes, modes, 2, generator=g) * 2 * math.pi
    x = torch.arange(size, dtype=torch.float64)
    k = torch.arange(1, modes + 1, dtype=torch.float64)
    if boundary == "circular":
        ax = 2 * math.pi * k[:, None] * x[None, :] / size  # (modes, size)
        fx = torch.cos(ax[None, :, None, :] + phase[..., 0, None])  # (n, kx, ky, size)
        fy = torch.cos(ax[None, None, :, :] + phase[..., 1, None])
    else:
        ax = math.pi * k[:, None] * (x[None, :] + 1) / (size + 1)
        fx = torch.sin(ax)[None, :, None, :].expand(n, modes, modes, size)
        fy = torch.sin(ax)[None, None, :, :].expand(n, modes, modes, size)
    u = torch.einsum("nab,nabi,nabj->nij", amp.double(), fx, fy)
    return u[:, None].float()


def evolve(u: torch.Tensor, r: float, steps: int, boundary: str) -> torch.Tensor:
    """``steps`` explicit steps of the heat equation."""
    lap = torch.tensor([[0, 1, 0], [1, -4, 1], [0, 1, 0]], dtype=torch.float64).view(1, 1, 3, 3)
    u = u.double()
    for _ in range(steps):
        padded = F.pad(u, (1, 1, 1, 1), mode="circular" if boundary == "circular" else "constant")
        u = u + r * F.conv2d(padded, lap)
    return u.float()


def make_fields(cfg: Heat2DConfig, seed: int) -> tuple[Fields, Fields]:
    """(train, validation) fields from ``seed``."""
    u0 = initial_fields(cfg.heat_samples, cfg.grid_size, cfg.boundary, seed)
    uT = evolve(u0, cfg.heat_diffusivity, cfg.heat_substeps, cfg.boundary)
    n_val = max(1, cfg.heat_samples // 8)
    return Fields(u0[:-n_val], uT[:-n_val]), Fields(u0[-n_val:], uT[-n_val:])
