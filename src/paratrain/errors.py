"""Errors whose message says everything: the launcher reports them without a traceback."""

from __future__ import annotations


class RunError(RuntimeError):
    """A failure of the run (a hang, a non-finite loss, a checkpoint that cannot be written)
    whose message names what happened, where, and what to do. A rank that raises one is
    reported by its message alone; any other exception is reported with its traceback."""
