"""Start a world of processes: spawn local ones, or join the world ``torchrun`` made.

``spawn(fn, nproc, *args)`` runs ``fn(*args)`` on ``nproc`` local processes after setting
up ``torch.distributed`` in each, and returns every rank's result. If any rank raises,
the others are killed at once and ``RankFailed`` carries that rank's traceback; a world
that outlives ``timeout_s`` is killed and reported the same way. Tests, benchmarks and
``paratrain train`` all start their processes through here.

Every rank runs a watchdog (watchdog.py): a collective stuck for ``collective_timeout_s``
is reported with the ranks that never arrived, and a rank whose launcher died removes the
temporary directory and exits. Ranks ignore Ctrl-C: the launcher handles it, once.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from .errors import RunError
from .proc import start_time
from .watchdog import Watchdog


class JoinError(RunError):
    """A rank could not join the process group (a peer never arrived)."""


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
    store_at: tuple[str, int, bool] | None = None
    """Under torchrun: the rendezvous store (host, port, whether torchrun's agent hosts it)."""
    attempt: int = 0
    """Under torchrun: how many times the job was restarted before (``--max-restarts``)."""
    local_world_size: int = 1
    """Processes on this machine (they share its memory)."""
    job: str = ""
    """Under torchrun: who this job is, the same in every attempt (``job_identity``)."""


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
        store_at=(env["MASTER_ADDR"], int(env.get("MASTER_PORT", "0")),
                  env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"),
        attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        job=job_identity(env.get("TORCHELASTIC_RUN_ID", ""), os.getppid()),
    )


def job_identity(run_id: str, agent_pid: int) -> str:
    """A torchrun job's identity across its restarts: torchrun's run id (``--rdzv-id``; a
    fresh uuid per ``--standalone`` job). Without one (torchrun's default id is the literal
    'none', shared by every job) it is the agent that restarts the ranks: its host, pid and
    start time, so a pid reused after a reboot is another job."""
    if run_id and run_id != "none":
        return f"rdzv-{run_id}"
    return f"agent-{socket.gethostname()}-{agent_pid}-{start_time(agent_pid)}"


def init_world(spec: WorldSpec, threads: int = 1) -> None:
    """Join the process group described by ``spec`` (and pin this rank's GPU under nccl)."""
    # One thread per rank: ranks share the machine's cores, and oversubscription makes
    # every rank slower than the sum of their work.
    torch.set_num_threads(threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.store_at is None:
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
        return
    dist.init_process_group(spec.backend, store=_attempt_store(spec, timeout), rank=spec.rank,
                            world_size=spec.world_size, timeout=timeout)


def _attempt_store(spec: WorldSpec, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, seen under a prefix of its own for this attempt. torchrun keeps one
    store across restarts, so a restarted rank would otherwise read the address a killed peer
    published in the attempt before, and fail to connect to it."""
    host, port, agent_hosts_it = spec.store_at
    store = dist.TCPStore(host, port, spec.world_size, is_master=spec.rank == 0 and not agent_hosts_it,
                          timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"paratrain/attempt-{spec.attempt}", store)


def _worker(local_rank: int, fn: Callable, args: tuple, init_method: str, world: int,
            backend: str, result_dir: str, collective_timeout_s: float, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's: one report, not one per rank
    # tqdm's default lock is a multiprocessing semaphore, which a killed rank would leak
    # (and the launcher's resource tracker then warns about it); a thread lock suffices.
    tqdm.set_lock(threading.RLock())
    watchdog = Watchdog(local_rank, collective_timeout_s, lambda report: _hung(result_dir, local_rank, report))
    watchdog.guard_parent(parent, result_dir).start()
    spec = WorldSpec(local_rank, world, local_rank, backend, init_method, collective_timeout_s)
    open(os.path.join(result_dir, f"joining{local_rank}"), "w").close()  # reached the rendezvous
    try:
        enter_world(spec)
        watchdog.attach(dist.distributed_c10d._get_default_store())
        result = fn(*args)
        torch.save(result, os.path.join(result_dir, f"rank{local_rank}.pt"))
        dist.barrier()  # tear down together: no rank closes connections a peer still uses
    except BaseException as exc:
        # torch's own timeout may raise before the watchdog fires: report the hang alike.
        _record_failure(result_dir, local_rank, watchdog.hang_report() or describe_error(exc))
        raise
    finally:
        watchdog.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def enter_world(spec: WorldSpec) -> None:
    """``init_world``, its failure named: torch's "Wait timeout" says neither who nor why."""
    try:
        init_world(spec)
    except Exception as exc:
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise JoinError(f"rank {spec.rank} could not join the world of {spec.world_size} "
                        f"within {spec.timeout_s:g} s (--timeout-s): {last}") from None


def describe_error(exc: BaseException) -> str:
    """A RunError by its message (it says everything); anything else with its traceback."""
    if isinstance(exc, RunError):
        return f"{type(exc).__name__}: {exc}"
    return traceback.format_exc()


def _record_failure(result_dir: str, rank: int, text: str) -> None:
    """Record when this rank failed: the first failure is the cause, the ranks that fail
    after it usually just lost their peer."""
    path = os.path.join(result_dir, f"error{rank}.txt")
    with open(path + ".tmp", "w") as f:
        f.write(f"{time.time()}\n{text}")
    os.replace(path + ".tmp", path)  # atomic: the launcher may kill us mid-write


def _hung(result_dir: str, rank: int, report: str) -> None:
    """The watchdog's verdict (called on its thread, while the main thread is stuck)."""
    _record_failure(result_dir, rank, report)
    os._exit(1)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "auto",
          timeout_s: float | None = 600.0, collective_timeout_s: float = 300.0,
          scratch: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` fresh processes joined in one world; return their
    results in rank order. ``fn`` must be importable by name (a module-level function).

    ``timeout_s`` bounds the whole world (None: no bound); ``collective_timeout_s`` bounds
    how long any one collective waits for a peer. The rendezvous and the ranks' results
    live in a directory made under ``scratch`` (``paratrain train``: the run directory, which
    the run owns) or, by default, the system's temporary directory, and are removed after."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    backend = pick_backend(backend)
    if backend == "nccl" and nproc > torch.cuda.device_count():
        raise ValueError(f"nccl needs one GPU per process: {nproc} processes, "
                         f"{torch.cuda.device_count()} GPUs; lower --nproc or use gloo")
    # Absolute: the rendezvous is a file:// URL, where a relative path would read as a host.
    workdir = os.path.abspath(tempfile.mkdtemp(prefix=".launch-" if scratch else "paratrain-", dir=scratch))
    try:
        # A file rendezvous needs no free port, so concurrent worlds cannot collide.
        init_method = "file://" + os.path.join(workdir, "rendezvous")
        saved, tempfile.tempdir = tempfile.tempdir, workdir  # torch's error files go there too
        try:
            ctx = mp.start_processes(
                _worker, args=(fn, args, init_method, nproc, backend, workdir, collective_timeout_s,
                               os.getpid()),
                nprocs=nproc, join=False, start_method="spawn",
            )
        finally:
            tempfile.tempdir = saved
        _join(ctx, timeout_s, workdir)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False)
                for r in range(nproc)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _join(ctx: mp.ProcessContext, timeout_s: float | None, workdir: str) -> None:
    """Wait for every rank; at the first that fails, report and kill the others. (Not
    ``ctx.join``: it SIGTERMs the survivors first, which would hide who died of what.)"""
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    procs = ctx.processes
    try:
        while True:
            running = [p.sentinel for p in procs if p.exitcode is None]
            if not running:
                break
            mp_connection.wait(running, timeout=0.2)
            if not os.path.isdir(workdir):  # a temporary-file cleaner, or a hand
                _kill(ctx)
                raise RankFailed(f"the launcher's scratch directory {workdir} was removed while the "
                                 f"run was going, and with it the ranks' rendezvous and results; "
                                 f"the run was ended (its checkpoints are kept: --resume auto "
                                 f"continues it)")
            # A recorded failure counts at once: its rank may take a while to exit (a peer
            # it waits for in teardown is stopped).
            if (any(p.exitcode not in (None, 0) for p in procs) or _any_failure(workdir)
                    or _silent_exits(procs, workdir)):
                time.sleep(0.1)  # let a peer that lost this rank record its side too
                report = _failure_report(procs, workdir)
                _kill(ctx)
                raise RankFailed(report)
            if time.monotonic() > deadline:
                alive = [i for i, p in enumerate(procs) if p.is_alive()]
                _kill(ctx)
                raise RankFailed(f"the run passed its time limit of {timeout_s:g} s (--max-time-s) "
                                 f"and was ended; ranks {alive} were still running")
    except RankFailed:
        raise
    except BaseException:
        _kill(ctx)  # Ctrl-C in the launcher must not leave ranks behind
        raise


def _failure_report(procs: list, workdir: str) -> str:
    """Ranks killed by a signal or stopped come first (they cannot report themselves; the
    peers that lost them fail after), then the first failure a rank recorded."""
    lines = []
    for rank, p in enumerate(procs):
        if p.exitcode is not None and p.exitcode < 0:
            lines.append(f"rank {rank} was killed by {signal.Signals(-p.exitcode).name} "
                         f"(out of memory, or killed from outside?)")
        elif p.exitcode is None and _stopped(p.pid):
            lines.append(f"rank {rank} (pid {p.pid}) is stopped (SIGSTOP?)")
    lines += _silent_exits(procs, workdir)
    lines += [f"rank {rank} never reached the process group's rendezvous (stuck before it, "
              f"in its imports or start-up?)" for rank, p in enumerate(procs)
              if p.exitcode is None and not os.path.exists(os.path.join(workdir, f"joining{rank}"))]
    first = _first_failure(workdir, after_a_loss=bool(lines))
    if first:
        lines.append(first)
    if not lines:
        lines += [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
    return "\n".join(lines)


def _silent_exits(procs: list, workdir: str) -> list[str]:
    """Ranks that ended, with any code, recording neither an error nor a result (os._exit,
    or a library's sys.exit): like a killed rank they cannot report themselves, and the
    peers that lose them fail after them."""
    return [f"rank {rank} exited with code {p.exitcode} while its peers were running, without "
            f"an error or a result (os._exit, or sys.exit in a library?)"
            for rank, p in enumerate(procs)
            if p.exitcode is not None and p.exitcode >= 0
            and not os.path.exists(os.path.join(workdir, f"error{rank}.txt"))
            and not os.path.exists(os.path.join(workdir, f"rank{rank}.pt"))]


def _any_failure(workdir: str) -> bool:
    return any(n.startswith("error") and n.endswith(".txt") for n in os.listdir(workdir))


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _first_failure(workdir: str, after_a_loss: bool = False) -> str | None:
    """The traceback of the rank that failed first, naming the ranks that followed.
    ``after_a_loss``: a rank was killed, stopped or vanished before (it could not record
    itself), so this one failed after it, not first."""
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
    same = [r for _, r, text in failures[1:] if text == tb]
    if same:  # e.g. a non-finite loss, which every rank sees
        return f"ranks {sorted([rank, *same])} failed:\n{tb}"
    others = [r for _, r, _ in failures[1:]]
    after = f" (then ranks {others} failed, having lost their peer)" if others else ""
    when = "then failed (having lost that rank?)" if after_a_loss else "failed first"
    return f"rank {rank} {when}{after}:\n{tb}"


def _kill(ctx: mp.ProcessContext) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    for p in ctx.processes:
        p.join(timeout=5)
