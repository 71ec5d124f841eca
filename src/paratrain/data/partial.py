"""The ``OUT.partial`` directory a ``data prepare`` writes into, owned by one process: a
killed prepare's is cleared by the next, a running one's is left alone; and the workers
that end with the prepare that started them."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from .. import console, proc
from .errors import DataError

log = console.get(__name__)


OWNER = ".owner"
"""In the ``.partial`` directory: the pid and start time of the prepare writing it."""


def claim(tmp: Path, out: str) -> None:
    """Make ``tmp`` this process's, removing one an interrupted prepare left (its owner is
    gone: killed, or the machine restarted); refuse one a running prepare is writing."""
    if tmp.exists():
        try:
            pid, started = (tmp / OWNER).read_text().split()
            running = proc.alive(int(pid), started)
        except (OSError, ValueError):  # no owner recorded: a directory being created
            pid, running = "?", True
        if running:
            raise DataError(f"{tmp} exists: prepare process {pid} is writing --out {out}; wait "
                            f"for it, or stop it and run again")
        log.warning(f"paratrain data prepare: removing {tmp}, left by an interrupted prepare "
                    f"(process {pid} is gone)")
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:  # a parent that is a file, or not writable
        raise DataError(f"--out {out}: cannot create {tmp} ({exc.strerror})") from None
    (tmp / OWNER).write_text(f"{os.getpid()} {proc.start_time(os.getpid())}")


def die_with_parent() -> None:
    """Worker initializer: end this worker when the prepare that started it dies, even by
    SIGKILL, which runs no cleanup (Linux; elsewhere the pool's own shutdown only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def release(tmp: Path) -> None:
    """The dataset in ``tmp`` is complete: drop the owner record before it is renamed."""
    (tmp / OWNER).unlink()
