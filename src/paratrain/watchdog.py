"""Each rank's watchdog: it names a hang, and it ends the rank when the launcher dies.

One daemon thread per rank wakes every ``period`` seconds (at most 1 s). The training step
pays nothing for it: everything it needs is already kept by torch or by the interpreter.

* **Progress.** torch numbers the collectives of every process group; the thread reads
  those sequence numbers and where the main thread is (``sys._current_frames``): which
  torch.distributed call, on which group, at which step of the training loop.
* **Heartbeat.** It publishes that record, with the time, in the rendezvous store, where
  every rank of the world can read it.
* **Hang.** If the main thread waits on a collective and nothing moved for ``timeout_s``
  (no collective issued, the main thread at the same instruction), it writes a report and
  ends the process. (A long computation is not a hang: its peers, waiting for it in the
  next collective, report it.) The report compares the
  heartbeats: a peer of the group that issued fewer collectives on it never arrived, and a
  peer whose heartbeat is stale is stopped or frozen (a SIGSTOPped rank cannot speak for
  itself, so the others must name it).
* **Launcher death.** Under ``spawn`` the rank asks Linux for ``PARENT_DEATH`` when its
  parent dies (``PR_SET_PDEATHSIG``); the signal wakes this thread even while the main thread
  is blocked in a collective, and it removes the launcher's temporary directory and exits. A
  changed parent pid does the same, for the instant before the signal was armed.
"""

from __future__ import annotations

import json
import linecache
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import netfault

HEARTBEAT = "paratrain/heartbeat/"
LOOPS = ("train/loop.py",)
"""The training loop whose ``train`` frame holds the step (0-based ``step``)."""
PARENT_DEATH = signal.SIGRTMIN
"""The signal a rank gets when its launcher dies: its own, not SIGTERM. Linux sends it each
time the ranks pass to another parent, so a killed launcher sends it once per launcher
thread that held them as its threads die, then once more for init; as SIGTERM the training
loop took the first for a preemption and the second for "stop now" (an ``os._exit`` that
skipped removing the launcher's directory). No scheduler or user sends a real-time signal."""


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (elsewhere: no-op)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)


class Watchdog:
    """Watches this rank's collectives (after ``attach``) and its parent (``guard_parent``)."""

    def __init__(self, rank: int, timeout_s: float, on_hang: Callable[[str], None],
                 max_time_s: float = 0.0):
        self.rank, self.timeout_s, self.on_hang, self.max_time_s = rank, timeout_s, on_hang, max_time_s
        self.period = max(0.05, min(1.0, timeout_s / 5))
        self.beat_every = max(self.period, min(10.0, timeout_s / 6))
        self.stale_s = max(3 * self.period, timeout_s / 2)
        self._store = None
        self._parent: int | None = None
        self._cleanup: str | None = None
        self._wake_fd: int | None = None
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._writing = threading.Lock()
        self._dying = threading.Lock()
        self._signature: tuple = ()
        self._since = self._started = time.monotonic()
        self._last_beat = 0.0
        self._state: dict = {}
        self._thread = threading.Thread(target=self._run, name="paratrain-watchdog", daemon=True)
        self.cleanups: list[Callable[[], None]] = []
        self.addresses: list[str] | None = None
        """Each rank's address (netfault.share_addresses), once known: a hang whose silent
        peers are all on another node is named as a lost link."""
        """Run before this process ends itself (its parent gone, SIGTERM, a hang named by the
        caller through ``exit``): what a ``finally`` would do, which ``os._exit`` skips."""

    # ---- set-up (main thread) ------------------------------------------------------------
    def guard_parent(self, parent_pid: int, cleanup_dir: str | None) -> "Watchdog":
        """End this process, removing ``cleanup_dir``, as soon as ``parent_pid`` dies."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        # Whichever sees the signal first, the main thread (between two bytecodes) or this
        # thread (woken by the signal even while the main thread is blocked in C++), ends it.
        self._sigterm = lambda signum, frame: self._die_with_parent()
        signal.signal(signal.SIGTERM, self._sigterm)
        signal.signal(PARENT_DEATH, self._sigterm)  # never the training loop's (train/preempt.py)
        signal.set_wakeup_fd(write)
        set_parent_death_signal(PARENT_DEATH)
        self._parent, self._cleanup, self._wake_fd = parent_pid, cleanup_dir, read
        if os.getppid() != parent_pid:  # died before the signal was armed
            self._die_with_parent()
        return self

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def attach(self, store) -> None:
        """Start watching collectives, publishing heartbeats into ``store``."""
        self._since = time.monotonic()
        self._store = store

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 1)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._sleep()
            if self._parent is not None and os.getppid() != self._parent:
                self._die_with_parent()
            if self._store is None or self._stop.is_set():
                continue
            try:
                self._sample()
            except Exception:  # noqa: BLE001  (a torn-down group while stopping)
                continue
            now = time.monotonic()
            if self._state["waiting"] and now - self._since >= self.timeout_s:
                self.on_hang(self.report(now - self._since))
            if self.max_time_s and now - self._started >= self.max_time_s:
                self.on_hang(f"the run exceeded --max-time-s {self.max_time_s:g} at step "
                             f"{self._state.get('step')}; ending the job")

    def _sleep(self) -> None:
        if self._wake_fd is None:
            self._stop.wait(self.period)
            return
        ready, _, _ = select.select([self._wake_fd], [], [], self.period)
        if ready:
            try:
                signals = os.read(self._wake_fd, 64)
            except BlockingIOError:
                return
            if PARENT_DEATH in signals:
                self._die_with_parent()
            elif signal.SIGTERM in signals:
                self._on_sigterm()

    def _on_sigterm(self) -> None:
        """SIGTERM woke this thread. While the training loop has taken the signal over (a
        preemption: it saves, then ends, train/preempt.py) it is the loop's; the launcher's
        death comes as PARENT_DEATH, which stays ours."""
        if signal.getsignal(signal.SIGTERM) is not self._sigterm:
            return
        self._die_with_parent()

    def _die_with_parent(self) -> None:
        # One ending at a time: the death signal comes more than once, and a second one must
        # neither wait on the first's lock (nested in the main thread) nor race its clean-up.
        if not self._dying.acquire(blocking=False):
            return
        self._writing.acquire(timeout=2)  # no heartbeat of ours lands after the clean-up
        # The signal comes when the parent's *thread* exits; its other threads may still be
        # dying, and until they are, getppid() names the old parent. Give them a moment.
        deadline = time.monotonic() + 1.0
        while self._parent is not None and os.getppid() == self._parent and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._cleanup and (self._parent is None or os.getppid() != self._parent):
            for _ in range(3):  # again, after a peer's last write
                shutil.rmtree(self._cleanup, ignore_errors=True)
                time.sleep(0.1)
        self.exit(128 + signal.SIGTERM)

    def exit(self, code: int) -> None:
        """End this process now with ``code``, after its ``cleanups``."""
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception:  # noqa: BLE001  (ending anyway: one failed clean-up stops no other)
                pass
        os._exit(code)

    def _sample(self) -> None:
        seqs = _sequence_numbers()
        frame = sys._current_frames().get(self._main)
        signature = (tuple(sorted(seqs.items())), id(frame), frame.f_lasti if frame else -1)
        now = time.monotonic()
        if signature != self._signature:
            self._signature, self._since = signature, now
        self._state = {"seqs": seqs, **_where(frame), "blocked_s": now - self._since,
                       "pid": os.getpid(), "host": socket.gethostname()}
        if now - self._last_beat >= self.beat_every or self._state["blocked_s"] >= self.period:
            self._last_beat = now
            with self._writing:
                self._store.set(HEARTBEAT + str(self.rank), json.dumps({**self._state, "t": time.time()}))

    # ---- reports -------------------------------------------------------------------------
    def hang_report(self) -> str | None:
        """The hang report if the main thread was stuck for at least half the timeout (for
        when torch's own timeout raised in the main thread before this thread fired)."""
        blocked = time.monotonic() - self._since
        if self._store is None or blocked < self.timeout_s / 2:
            return None
        return self.report(blocked)

    def report(self, blocked_s: float) -> str:
        """Which rank waited where, and which peers did not arrive (from their heartbeats)."""
        me = self._state
        group = me.get("group") or _behind_group(me.get("seqs", {}), {}) or "0"
        members = _members(group)
        beats = _read_heartbeats(self._store, members, timeout_s=3.0)
        group = me.get("group") or _behind_group(me.get("seqs", {}), beats) or group
        members = _members(group)
        mine = me.get("seqs", {}).get(group, 0)
        missing, waiting = [], []
        for peer in members:
            if peer == self.rank:
                continue
            why = _absence(beats.get(peer), group, mine, self.stale_s)
            (missing if why else waiting).append(f"rank {peer}{why}")
        call = me.get("call") or f"{me.get('where') or 'an unknown place'}"
        step = me.get("step") if me.get("step") is not None else "?"
        inside = f" inside {me['inside']}" if me.get("inside") else ""
        lines = [f"hang at step {step}: rank {self.rank} waited {blocked_s:.1f} s in "
                 f"{call} on group {_describe(group)}{inside}, its collective #{mine} there "
                 f"(--timeout-s {self.timeout_s:g}); "
                 + (f"did not arrive: {'; '.join(missing)}" if missing else
                    "every peer reports it is waiting too (a collective issued in a different order?)"
                    if waiting else "no peer to compare with")]
        if waiting:
            lines.append(f"waiting as well: {', '.join(waiting)}")
        silent = [r for r in members if r != self.rank and
                  _absence(beats.get(r), group, mine, self.stale_s).startswith((" (silent", " (no heart"))]
        cut = netfault.unreachable(silent, self.addresses, self.rank, store_lost=not beats)
        if cut:
            lines.append(cut)
        return "\n".join(lines)


def _sequence_numbers() -> dict[str, int]:
    """Collectives issued so far on each process group of this rank, by group name."""
    out = {}
    for pg in list(c10d._world.pg_group_ranks):
        name = c10d._world.pg_names.get(pg)
        if name is not None:
            out[name] = pg._get_sequence_number_for_group()
    return out


def _where(frame) -> dict:
    """The torch.distributed call the main thread is in (outermost such frame) and its
    group, else the innermost paratrain function; and the training step (read from the
    loop's frame, so the loop pays nothing)."""
    out: dict = {"call": None, "group": None, "where": None, "step": None, "waiting": False,
                 "inside": None}
    if frame is not None:  # a wait on an asynchronous collective's handle, or a sync one
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        out["waiting"] = any(w in line for w in (".wait(", "wait_all(", "synchronize("))
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path:
            # The outermost call names it (all_gather_object, not the all_gather inside), and
            # the innermost frame with a group says which: torch wraps every collective in a
            # c10d_logger ``wrapper`` whose frame holds no ``group``.
            out["waiting"] = True
            if code.co_name != "wrapper":
                out["call"] = code.co_name
            if out["group"] is None and "group" in frame.f_locals:
                group = frame.f_locals["group"]
                out["group"] = c10d._world.pg_names.get(group) if group is not None else "0"
        elif "/paratrain/" in path:
            if out["where"] is None:
                out["where"] = f"{code.co_name} ({path.rsplit('/paratrain/', 1)[1]}:{frame.f_lineno})"
            if out["inside"] is None:  # a layer that labels its collectives (parallel/expert.py)
                out["inside"] = _label(frame.f_locals)
        if (out["step"] is None and path.endswith(LOOPS) and code.co_name == "train"
                and isinstance(frame.f_locals.get("step"), int)):  # the loop's own, 0-based
            out["step"] = frame.f_locals["step"] + 1  # as metrics.jsonl numbers it
        frame = frame.f_back
    return out


def _label(local: dict) -> str | None:
    """What a frame says its collectives belong to: a ``watch_label`` variable, or the
    attribute of an autograd function's ``ctx`` (a collective in backward)."""
    label = local.get("watch_label", getattr(local.get("ctx"), "watch_label", None))
    return label if isinstance(label, str) and label else None


def _members(group: str) -> list[int]:
    for pg, ranks in list(c10d._world.pg_group_ranks.items()):
        if c10d._world.pg_names.get(pg) == group:
            return sorted(ranks)
    return list(range(dist.get_world_size())) if dist.is_initialized() else []


def _describe(group: str) -> str:
    for pg in list(c10d._world.pg_group_ranks):
        if c10d._world.pg_names.get(pg) == group:
            desc = "world" if group == "0" else (pg.group_desc or "")
            return f"{desc} (ranks {_members(group)})".strip()
    return group


def _behind_group(seqs: dict[str, int], beats: dict[int, dict]) -> str | None:
    """The group on which some peer issued fewer collectives than this rank."""
    for group, seq in sorted(seqs.items(), key=lambda kv: -kv[1]):
        for peer in _members(group):
            beat = beats.get(peer)
            if beat is not None and beat["seqs"].get(group, 0) < seq:
                return group
    return None


def _absence(beat: dict | None, group: str, mine: int, stale_s: float) -> str:
    """Why a peer is not in the collective ('' when it is waiting in it too)."""
    if beat is None:
        return " (no heartbeat at all: it never got this far, or died)"
    age = time.time() - beat["t"]
    theirs = beat["seqs"].get(group, 0)
    step = beat.get("step")
    seen = f"last seen at step {'?' if step is None else step}, collective #{theirs} of this group, in {beat.get('call') or beat.get('where')}"
    if age > stale_s:
        return f" (silent for {age:.1f} s: stopped or frozen, pid {beat.get('pid')} on {beat.get('host')}; {seen})"
    if theirs < mine:
        return f" (alive but elsewhere: {seen})"
    return ""


def _read_heartbeats(store, ranks: list[int], timeout_s: float) -> dict[int, dict]:
    """Heartbeats of ``ranks`` from the store, giving up after ``timeout_s`` (a stopped peer
    may hold the store's file lock)."""
    beats: dict[int, dict] = {}

    def read() -> None:
        for r in ranks:
            key = HEARTBEAT + str(r)
            if store.check([key]):
                beats[r] = json.loads(store.get(key))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return dict(beats)
