"""Turn a plain model into a parallel one, in a fixed order.

The order is the one every strategy of paratrain composes in:
TP/SP -> CP -> pipeline split -> activation checkpointing -> ZeRO/DDP wrapping.
This version implements the last step (data parallelism over the dp x cp group); the
others are rejected up front by ``Config.validate``.
"""

from __future__ import annotations

from torch import nn

from .mesh import Mesh
from .parallel.data import DataParallel
from .train.config import Config


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Wrap ``model`` (already on ``mesh.device``) for the layout in ``cfg``.

    Gradients are averaged over dp x cp: context-parallel ranks hold the same weights but
    see different tokens, exactly like data-parallel replicas.
    """
    return DataParallel(model, mesh.group("dp-cp"), bucket_mb=cfg.parallel.bucket_mb)
