"""What each rank runs for ``paratrain train``, whoever started it."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from ..launch import WorldSpec, init_world
from ..mesh import Mesh
from ..watchdog import Watchdog
from .config import Config
from .loop import train
from .rundir import RunDirLock


def run_worker(cfg: Config, world: WorldSpec | None) -> None:
    """Train on this rank. ``world`` is given when torchrun started the process (the group
    is then joined here, with a watchdog, and global rank 0 locks the run directory); the
    local launcher has already done all that."""
    if world is None:
        train(cfg, Mesh.build(cfg.layout))
        dist.barrier()  # tear down together: no rank closes connections a peer still uses
        return
    watchdog = Watchdog(world.rank, world.timeout_s, _die_named, cfg.parallel.max_time_s)
    watchdog.guard_parent(os.getppid(), None).start()  # die with the torchrun agent
    lock = RunDirLock(cfg) if world.rank == 0 else None
    try:
        if lock is not None:
            lock.acquire()
        init_world(world)
        watchdog.attach(dist.distributed_c10d._get_default_store())
        train(cfg, Mesh.build(cfg.layout))
        dist.barrier()
    except BaseException:
        report = watchdog.hang_report()
        if report:
            _die_named(report)
        raise
    finally:
        watchdog.stop()
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_named(report: str) -> None:
    """Under torchrun the agent ends the other ranks when one exits non-zero."""
    print(f"paratrain train: {report}", file=sys.stderr, flush=True)
    os._exit(1)
