"""What each rank runs for ``paratrain train``, whoever started it."""

from __future__ import annotations

import torch.distributed as dist

from ..launch import WorldSpec, init_world
from ..mesh import Mesh
from .config import Config
from .loop import train


def run_worker(cfg: Config, world: WorldSpec | None) -> None:
    """Train on this rank. ``world`` is given when torchrun started the process (the group
    is then joined here); the local launcher has already joined it."""
    if world is not None:
        init_world(world)
    try:
        train(cfg, Mesh.build(cfg.layout))
        dist.barrier()  # tear down together: no rank closes connections a peer still uses
    finally:
        if world is not None:
            dist.destroy_process_group()
