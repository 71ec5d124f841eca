"""Fixtures shared by every test module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable, Iterator

import pytest

from helpers import LONG_RUN, final_files
from paratrain.watchdog import set_parent_death_signal


@pytest.fixture
def background() -> Iterator[Callable[..., subprocess.Popen]]:
    """``subprocess.Popen`` for a command that cannot outlive its test.

    A test that fails while its job runs (``--steps 100000``, a torchrun agent) would leave
    the job computing for as long as the machine is up, slowing every later test. Each job
    gets a process group of its own, killed whole when the test ends: the ranks too, even
    where a deliberate bug (scripts/mutants.py) stops them dying with their launcher. Linux
    kills the job itself if pytest is killed (a timeout).
    """
    started: list[subprocess.Popen] = []

    def start(cmd: list[str], *, preexec_fn: Callable[[], None] | None = None, **kwargs) -> subprocess.Popen:
        def child() -> None:
            set_parent_death_signal(signal.SIGKILL)
            if preexec_fn is not None:
                preexec_fn()

        started.append(subprocess.Popen(cmd, preexec_fn=child, start_new_session=True, **kwargs))
        return started[-1]

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader
        except ProcessLookupError:
            pass
        proc.communicate()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> dict:
    """The final checkpoint's files of ``LONG_RUN`` uninterrupted, under paratrain's own
    launcher: what test_preempt's signalled runs and test_slurm's jobs must end with, bit for
    bit. One run for the session: both modules ran this same command, seconds each."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", *LONG_RUN, "--run-dir", str(run)],
                          cwd=run.parent, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL))
    assert done.returncode == 0, done.stderr[-3000:]
    return final_files(run)
