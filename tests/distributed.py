"""Spawn helper for multiprocess tests: run a module-level function on N gloo ranks.

Any rank's exception is re-raised in the test process as ``RankFailed`` carrying that
rank's traceback; a world that outlives ``timeout_s`` is killed and reported.
Starting a world costs seconds (each rank imports torch): check several related things
inside one world.
"""

from __future__ import annotations

from typing import Any, Callable

from paratrain.launch import spawn


def run_world(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(*args)`` on ``nproc`` gloo processes; returns each rank's result in rank order."""
    return spawn(fn, nproc, *args, backend="gloo", timeout_s=timeout_s)
