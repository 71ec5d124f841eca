"""Domain parallelism: every sample's spatial axes split over a grid of ranks, with halo
exchange at convolutions (see docs/domain-parallel.md).

``apply_domain_parallel(model, grid)`` swaps a plain model's spatial layers in place, by
the table ``SWAPS``: layer type -> what replaces it. Point-wise layers (activations, 1x1
convolutions are convolutions too, with no halo) need nothing. Layers that would need
something this package does not do are refused by ``REFUSED`` rather than run wrong.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from .halo import DomainError, Grid, Halo, HaloExchange, exchange, shard_sizes, shard_slice, wait
from .layers import DomainConv2d, DomainGroupNorm, LocalResample, check_upsample, conv_halo

SWAPS: dict[type, Callable[[nn.Module, Grid], nn.Module]] = {
    nn.Conv2d: DomainConv2d,
    nn.GroupNorm: DomainGroupNorm,
    nn.ConvTranspose2d: check_upsample,
    nn.MaxPool2d: LocalResample,
    nn.AvgPool2d: LocalResample,
}
REFUSED = {
    nn.BatchNorm2d: "batch norm's running statistics; use GroupNorm",
    nn.InstanceNorm2d: "instance norm; use GroupNorm(channels, channels)",
    nn.Upsample: "interpolating up-sampling; use ConvTranspose2d(kernel=stride)",
    nn.Conv1d: "1-D convolutions", nn.Conv3d: "3-D convolutions",
}

__all__ = ["DomainConv2d", "DomainError", "DomainGroupNorm", "Grid", "Halo", "HaloExchange",
           "LocalResample", "SWAPS", "apply_domain_parallel", "conv_halo", "exchange",
           "shard_sizes", "shard_slice", "wait"]


def apply_domain_parallel(model: nn.Module, grid: Grid) -> nn.Module:
    """Swap ``model``'s spatial layers for their domain-parallel versions, in place."""
    for name, child in list(model.named_children()):
        if type(child) in REFUSED:
            raise DomainError(f"{name}: domain parallelism does not support "
                              f"{REFUSED[type(child)]}")
        swap = SWAPS.get(type(child))
        if swap is not None:
            setattr(model, name, swap(child, grid))
        else:
            apply_domain_parallel(child, grid)
    return model
