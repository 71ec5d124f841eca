"""Fixtures shared by every test module."""

from __future__ import annotations

import signal
import subprocess
from typing import Callable, Iterator

import pytest

from paratrain.watchdog import set_parent_death_signal


@pytest.fixture
def background() -> Iterator[Callable[..., subprocess.Popen]]:
    """``subprocess.Popen`` for a command that cannot outlive its test.

    A test that fails while its job runs (``--steps 100000``, a torchrun agent) would leave
    the job computing for as long as the machine is up, slowing every later test: the job
    is killed when the test ends, and Linux kills it if pytest itself is killed (a timeout).
    Its ranks follow, since each rank dies with its launcher.
    """
    started: list[subprocess.Popen] = []

    def start(cmd: list[str], *, preexec_fn: Callable[[], None] | None = None, **kwargs) -> subprocess.Popen:
        def child() -> None:
            set_parent_death_signal(signal.SIGKILL)
            if preexec_fn is not None:
                preexec_fn()

        started.append(subprocess.Popen(cmd, preexec_fn=child, **kwargs))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
