"""Preemption: a scheduler's SIGTERM (or the SIGUSR1 Slurm's ``--signal`` sends) asks a run
to stop; it finishes the step it is in, saves a checkpoint and ends resumable.

Each rank counts the signals it got (``Preemption``, installed for the duration of the
training loop). After every step the ranks agree whether any of them got one (one small
all-reduce): signals reach ranks at different instants, and every rank must stop after
the same step. The loop then saves, writes ``preempted.json`` in the run directory (the
step, the checkpoint, the resume command) and returns; ``paratrain train`` exits with
``EXIT_PREEMPTED``. A second signal ends the rank at once: a checkpoint being written is
then never published (publishing is atomic), and ``--resume auto`` takes the newest whole
one.

The rank's watchdog leaves SIGTERM to this handler while it is installed; the launcher's
death reaches the rank as another signal, the watchdog's own (watchdog.PARENT_DEATH).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75
"""The exit status of a preempted run that saved and can resume (sysexits' EX_TEMPFAIL:
"try again later")."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
MARKER = "preempted.json"


class Preemption:
    """Counts SIGTERM and SIGUSR1 while the training loop runs (a context manager)."""

    def __init__(self):
        self.signals = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.signals += 1
        if self.signals > 1:  # asked twice: stop now, whatever is half-written stays unpublished
            os._exit(128 + signum)

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was signalled (collective over the world: every rank calls it
        after the same step)."""
        flag = torch.tensor([float(self.signals > 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def write_marker(run_dir: Path, step: int, checkpoint: str, resume: str) -> Path:
    """``preempted.json``: where the run stopped and how to go on."""
    path = Path(run_dir) / MARKER
    path.write_text(json.dumps({"step": step, "checkpoint": checkpoint, "resume": resume}, indent=1) + "\n")
    return path
