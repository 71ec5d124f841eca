"""What each rank runs for ``paratrain train``, whoever started it."""

from __future__ import annotations

import os
import sys
from typing import Mapping

import torch.distributed as dist

from .. import console, netfault
from ..launch import WorldSpec, enter_world
from ..mesh import Mesh
from ..watchdog import Watchdog
from .config import Config, ConfigError
from .loop import train
from .rundir import RunDirLock
from .saved import how_to_resume


def run_worker(cfg: Config, world: WorldSpec | None) -> int | None:
    """Train on this rank; returns the step a preemption stopped it after, or None.
    ``world`` is given when torchrun (or srun, slurm.py) started the process (the group is then joined here,
    with a watchdog, and global rank 0 locks the run directory); the local launcher has
    already done all that."""
    console.configure(cfg.train.quiet)  # a spawned rank starts with logging unconfigured
    if world is None:
        preempted = train(cfg, Mesh.build(cfg.layout)).preempted_at
        dist.barrier()  # tear down together: no rank closes connections a peer still uses
        return preempted
    placed = [cfg]  # the run's config once rank 0 has placed it: a hang names its checkpoint
    watchdog = Watchdog(world.rank, world.timeout_s,
                        lambda report: _die_named(watchdog, f"{report}\n{how_to_resume(placed[0])}"),
                        cfg.parallel.max_time_s)
    watchdog.guard_parent(os.getppid(), None).start()  # die with the torchrun agent, or on SIGTERM
    lock, addresses = None, None
    try:
        enter_world(world)
        watchdog.attach(dist.distributed_c10d._get_default_store())
        addresses = netfault.share_addresses(world.store_at[0] if world.store_at else "127.0.0.1")
        watchdog.addresses = addresses
        cfg, lock = _agree_on_run(cfg, world)
        placed[0] = cfg
        if lock is not None:  # every way out releases it, os._exit's too: a requeue must start
            watchdog.cleanups.append(lock.release)
        preempted = train(cfg, Mesh.build(cfg.layout)).preempted_at
        dist.barrier()
        return preempted
    except BaseException as exc:
        report = watchdog.hang_report()
        if report:
            _die_named(watchdog, f"{report}\n{how_to_resume(cfg)}")
        lost = netfault.describe_lost_link(exc, addresses, world.rank) if addresses else None
        if lost is not None:  # one line per node, not every rank's gloo traceback
            if world.local_rank == 0:
                _die_named(watchdog, f"{lost}. {how_to_resume(cfg)} (under torchrun "
                                     f"--max-restarts the job restarts and resumes it itself)")
            watchdog.exit(1)
        raise
    finally:
        watchdog.stop()
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()


def _agree_on_run(cfg: Config, world: WorldSpec) -> tuple[Config, RunDirLock | None]:
    """Global rank 0 places the run (its directory, what it resumes: train/runs.py), locks
    the directory and records the config; every rank receives that decision (collective).
    A restarted torchrun job decides again, and finds the run its first attempt recorded."""
    from . import runs

    decision: list = [None]
    lock = None
    if world.rank == 0:
        try:
            job = runs.Job(world.job, world.attempt) if world.job else None
            cfg = runs.place_and_print(cfg, torchrun=True, job=job)
            lock = RunDirLock(cfg, job=world.job).acquire()
            runs.record(cfg)
            decision = [(cfg, "")]
        except Exception as exc:  # the other ranks wait in the broadcast: tell them
            if lock is not None:
                lock.release()
            decision = [(None, f"{type(exc).__name__}: {exc}")]
            dist.broadcast_object_list(decision, src=0)
            raise
    dist.broadcast_object_list(decision, src=0)
    placed, error = decision[0]
    if error:
        raise ConfigError(f"rank 0 could not set up the run: {error}")
    return placed, lock


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""Variables torchrun sets for every process it starts."""
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
"""Any one of these means a torchrun world was meant (MASTER_ADDR/PORT alone are often
exported cluster-wide, and the local launcher does not read them)."""


def started_by_torchrun(env: Mapping[str, str]) -> bool:
    """Whether torchrun started this process: all of ``TORCHRUN_VARS``, consistent. None
    of the rank variables: False. A partial or inconsistent set (left over from another
    job, or set by hand) raises ConfigError listing what is wrong: paratrain never guesses."""
    present = [k for k in _RANK_VARS if k in env]
    if not present:
        return False
    missing = [k for k in TORCHRUN_VARS if k not in env]
    if missing:
        raise ConfigError(
            f"torchrun variables {', '.join(present)} are set, but not {', '.join(missing)}, "
            f"which torchrun sets for every process it starts; left over from another job? "
            f"`unset {' '.join(k for k in TORCHRUN_VARS if k in env)}` to let paratrain start "
            f"its own processes, or start it with torchrun")
    try:
        rank, local, world, local_world = (int(env[k]) for k in _RANK_VARS[:4])
    except ValueError:
        raise ConfigError("torchrun variables must be integers: "
                          + ", ".join(f"{k}={env[k]!r}" for k in _RANK_VARS[:4])) from None
    if not (0 <= rank < world and 0 <= local < local_world <= world):
        raise ConfigError(f"inconsistent torchrun variables RANK={rank}, LOCAL_RANK={local}, "
                          f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}; unset them, "
                          f"or start paratrain with torchrun")
    return True


def _die_named(watchdog: Watchdog, report: str) -> None:
    """Under torchrun the agent ends the other ranks when one exits non-zero."""
    print(f"paratrain train: {report}", file=sys.stderr, flush=True)
    watchdog.exit(1)
