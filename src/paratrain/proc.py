"""Processes by identity, not by pid alone: a pid is reused (after a container restart, or
in a long-lived machine), its start time with it is not."""

from __future__ import annotations

import os
from pathlib import Path


def start_time(pid: int) -> str:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat); '' where
    /proc is not there or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # the name in parentheses may hold spaces


def alive(pid: int, started: str = "") -> bool:
    """Whether process ``pid`` runs on this machine and, when ``started`` is given (its
    ``start_time`` when it was recorded), is still that process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = start_time(pid)
    return not (started and now and now != started)
