"""Start a world of processes: spawn local ones, or join the world ``torchrun`` made.

``spawn(fn, nproc, *args)`` runs ``fn(*args)`` on ``nproc`` local processes after setting
up ``torch.distributed`` in each, and returns every rank's result. If any rank raises,
the others are killed at once and ``RankFailed`` carries that rank's traceback; a world
that outlives ``timeout_s`` is killed and reported the same way. Tests, benchmarks and
``paratrain train`` all start their processes through here.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank of a spawned world raised (or the world timed out)."""


@dataclass(frozen=True)
class WorldSpec:
    """How one process joins the world."""

    rank: int
    """Global rank of this process."""
    world_size: int
    """Number of processes in the world."""
    local_rank: int
    """Rank among the processes of this machine (selects the GPU under nccl)."""
    backend: str
    """'gloo' (CPU) or 'nccl' (GPU)."""
    init_method: str
    """Rendezvous URL for init_process_group ('env://' under torchrun)."""
    timeout_s: float = 300.0
    """How long a collective may wait for a peer before failing instead of hanging."""


def pick_backend(backend: str = "auto") -> str:
    """'auto' means nccl when CUDA is available, gloo otherwise."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r} is not one of auto, gloo, nccl")
    return backend


def torchrun_world(backend: str = "auto", timeout_s: float = 300.0) -> WorldSpec | None:
    """The world described by the variables torchrun sets, or None when not under torchrun.

    This is the one place paratrain reads the launcher's environment.
    """
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        return None
    return WorldSpec(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        backend=pick_backend(backend),
        init_method="env://",
        timeout_s=timeout_s,
    )


def init_world(spec: WorldSpec, threads: int = 1) -> None:
    """Join the process group described by ``spec`` (and pin this rank's GPU under nccl)."""
    # One thread per rank: ranks share the machine's cores, and oversubscription makes
    # every rank slower than the sum of their work.
    torch.set_num_threads(threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
    dist.init_process_group(
        spec.backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def _worker(local_rank: int, fn: Callable, args: tuple, init_method: str, world: int,
            backend: str, result_dir: str, collective_timeout_s: float) -> None:
    spec = WorldSpec(local_rank, world, local_rank, backend, init_method, collective_timeout_s)
    try:
        init_world(spec)
        result = fn(*args)
        torch.save(result, os.path.join(result_dir, f"rank{local_rank}.pt"))
        dist.barrier()  # tear down together: no rank closes connections a peer still uses
    except BaseException:
        # Record when this rank failed: the first failure is the cause, the ranks that
        # fail after it usually just lost their peer.
        path = os.path.join(result_dir, f"error{local_rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)  # atomic: the launcher may kill us mid-write
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "auto",
          timeout_s: float | None = 600.0, collective_timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` fresh processes joined in one world; return their
    results in rank order. ``fn`` must be importable by name (a module-level function).

    ``timeout_s`` bounds the whole world (None: no bound); ``collective_timeout_s`` bounds
    how long any one collective waits for a peer."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    backend = pick_backend(backend)
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise ValueError(f"nccl needs one GPU per process: {nproc} processes, "
                         f"{torch.cuda.device_count()} GPUs; lower --nproc or use gloo")
    workdir = tempfile.mkdtemp(prefix="paratrain-")
    try:
        # A file rendezvous needs no free port, so concurrent worlds cannot collide.
        init_method = "file://" + os.path.join(workdir, "rendezvous")
        ctx = mp.start_processes(
            _worker, args=(fn, args, init_method, nproc, backend, workdir, collective_timeout_s),
            nprocs=nproc, join=False, start_method="spawn",
        )
        _join(ctx, timeout_s, workdir)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False)
                for r in range(nproc)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _join(ctx: mp.ProcessContext, timeout_s: float | None, workdir: str) -> None:
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                _kill(ctx)
                raise RankFailed(f"world timed out after {timeout_s:.0f} s; ranks {alive} were "
                                 f"still running (a collective one rank never reached?)")
    except mp.ProcessRaisedException as exc:
        _kill(ctx)
        raise RankFailed(_first_failure(workdir) or f"rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        _kill(ctx)
        raise RankFailed(f"rank {exc.error_index} died with exit code {exc.exit_code} "
                         f"(signal {exc.signal_name}); out of memory?") from None
    except BaseException:
        _kill(ctx)  # Ctrl-C in the launcher must not leave ranks behind
        raise


def _first_failure(workdir: str) -> str | None:
    """The traceback of the rank that failed first, naming the ranks that followed."""
    failures = []
    for name in os.listdir(workdir):
        if name.startswith("error") and name.endswith(".txt"):
            with open(os.path.join(workdir, name)) as f:
                when, _, tb = f.read().partition("\n")
            failures.append((float(when), int(name[5:-4]), tb))
    if not failures:
        return None
    failures.sort()
    _, rank, tb = failures[0]
    others = [r for _, r, _ in failures[1:]]
    after = f" (then ranks {others} failed, having lost their peer)" if others else ""
    return f"rank {rank} failed first{after}:\n{tb}"


def _kill(ctx: mp.ProcessContext) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=5)
