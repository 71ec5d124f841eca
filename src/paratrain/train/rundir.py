"""One run per run directory: a lock file, and no fresh run over another run's checkpoints.

``RUN_DIR/.lock`` holds the pid, its start time and the host of the launcher that owns the
directory, and under torchrun the job's identity. A second run into it is refused with that
owner named. A lock is stale and taken over when its process is gone from this host (or
its pid now names another process, after a container restart), or when it was the same
torchrun job's (a restart, or a requeue on another node). The lock is taken before any rank starts, so a refused run costs
nothing, and while it is held the checkpoint check below cannot race with another run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid
from pathlib import Path

from ..errors import RunError
from ..paths import write_atomic
from ..proc import alive, start_time


class RunDirError(RunError):
    """The run directory is in use, holds another run's checkpoints, or is not writable."""


class RunDirLock:
    """The lock on ``cfg.train.run_dir``; ``acquire`` also refuses to overwrite checkpoints."""

    def __init__(self, cfg, job: str = ""):
        self.cfg = cfg
        self.job = job
        """The torchrun job taking the lock (``launch.job_identity``); '' for the local launcher."""
        self.run_dir = Path(cfg.train.run_dir)
        self.path = self.run_dir / ".lock"
        self.held = False

    def acquire(self) -> "RunDirLock":
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"--run-dir {str(self.run_dir)!r} is a file, not a directory; choose "
                              f"a directory (it is created if missing)")
        for _ in range(2):  # the second try follows the removal of a stale lock
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._break_if_stale()
                continue
            except OSError as exc:
                raise RunDirError(f"cannot write to the run directory {str(self.run_dir)!r}: "
                                  f"{exc.strerror}; choose a writable --run-dir") from None
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "start": start_time(os.getpid()), "host": socket.gethostname(),
                           "since": time.time(), "job": self.job}, f)
            self.held = True
            try:
                check_checkpoints(self.cfg)
            except RunDirError:
                self.release()  # refused: leave no lock behind
                raise
            return self
        raise RunDirError(f"could not lock {str(self.path)!r}; try again")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                self.path.unlink()
            except OSError:
                pass

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _break_if_stale(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
            pid, host = int(owner["pid"]), owner["host"]
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = {}, 0, socket.gethostname()  # half-written by a dead process
        ours = self.job and owner.get("job") == self.job  # a restart of the job that took it
        if ours or (host == socket.gethostname() and not alive(pid, str(owner.get("start", "")))):
            self.path.unlink(missing_ok=True)
            return
        since = time.strftime("%H:%M:%S", time.localtime(owner.get("since", 0)))
        raise RunDirError(f"the run directory {str(self.run_dir)!r} is in use by another paratrain "
                          f"run (pid {pid} on {host}, since {since}); wait for it to end, or choose "
                          f"another --run-dir (if that run is gone, remove {str(self.path)!r})")


def in_use(run_dir: Path) -> bool:
    """Whether another live run holds ``run_dir``'s lock (checks that would touch or judge
    its files wait for the lock, which then names that run)."""
    try:
        owner = json.loads((Path(run_dir) / ".lock").read_text())
        pid, host = int(owner["pid"]), owner["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return host != socket.gethostname() or alive(pid, str(owner.get("start", "")))


def check_checkpoints(cfg) -> None:
    """Refuse a run that would overwrite checkpoints another run wrote into its directory.
    A resumed run continues the run it resumes (same run id), so it may write there, but
    not beside checkpoints of that run newer than the one it resumes: a later
    ``--resume auto`` would take one of those and mix the two histories. A damaged
    checkpoint (no readable index) does not stop a resumed run: ``--resume auto`` skipped
    it, and the run replaces it when it saves that step."""
    if not cfg.train.save_every:
        return
    from .checkpoint import CheckpointError, read_meta

    folder = Path(cfg.train.run_dir) / "checkpoints"
    if folder.exists() and not folder.is_dir():  # else the first save fails, after the steps before it
        raise RunDirError(f"{str(folder)!r} is a file, not a directory, and --save-every writes "
                          f"checkpoints into it; move the file aside, or choose another --run-dir")
    existing = sorted(folder.glob("step-*"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    try:
        resumed = read_meta(cfg.train.resume) if cfg.train.resume else {}
    except CheckpointError:
        resumed = {}
    mine = resumed.get("run", {}).get("id")
    others, newer = [], []
    for path in existing:
        try:
            meta = read_meta(path)
        except CheckpointError:
            meta = None
        if meta is None and mine is not None:
            continue
        if mine is None or meta is None or meta.get("run", {}).get("id") != mine:
            others.append(path.name)
        elif meta["step"] > resumed["step"]:
            newer.append(path.name)
    if others:
        hint = (f"resume it with --resume auto (or --resume {folder / others[-1]}), "
                if mine is None else "")
        raise RunDirError(f"{str(folder)!r} holds checkpoints of another run ({', '.join(others)}), "
                          f"which this run would overwrite; {hint}choose another --run-dir, or remove them")
    if newer:
        raise RunDirError(f"{str(folder)!r} holds {', '.join(newer)} of the run that "
                          f"{cfg.train.resume!r} belongs to, newer than it: going on from there "
                          f"here would mix two histories (a later --resume auto takes "
                          f"{newer[-1]}); resume the newest with --resume auto, or go on from "
                          f"{cfg.train.resume!r} in another --run-dir")


RECORDS_OWNER = "run.json"
"""Names the run whose records (metrics, CSV) a run directory holds: ``{"id": RUN_ID}``."""


def claim_records(run_dir: Path, run_id: str) -> None:
    """Write ``RUN_DIR/run.json`` for the run that opens the directory's records (rank 0, as
    it opens them): a later resume into the directory can tell whose records it would cut."""
    path = Path(run_dir) / RECORDS_OWNER
    try:
        write_atomic(path, json.dumps({"id": run_id}) + "\n")
    except OSError as exc:  # a full disk: no 0-byte file left behind, and the failure named
        raise RunDirError(f"could not write {path}: {exc.strerror or exc}; free space in the "
                          f"run directory, or choose another --run-dir") from None


def records_owner(run_dir: Path) -> str | None:
    """The id of the run whose records ``run_dir`` holds; None when no run named itself
    (records from before ``run.json``, or none)."""
    try:
        return str(json.loads((Path(run_dir) / RECORDS_OWNER).read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def continued_run_id(meta: dict) -> str:
    """The id of the run a run continues: that of the checkpoint whose index ``meta`` it
    resumes ({} for a fresh run), else a new one."""
    return meta.get("run", {}).get("id") or uuid.uuid4().hex


def run_record(cfg, run_id: str) -> dict:
    """What a checkpoint's index says of the run that wrote it (``meta["run"]``)."""
    return {"id": run_id, "seed": cfg.train.seed, "config": dataclasses.asdict(cfg)}
