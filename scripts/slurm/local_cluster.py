#!/usr/bin/env python3
"""A one-node Slurm cluster on this machine, for tests and for trying the batch script.

    python scripts/slurm/local_cluster.py start DIR   # prints the `export SLURM_CONF=...` to use
    python scripts/slurm/local_cluster.py stop DIR

It runs Debian's ``munged``, ``slurmctld`` and ``slurmd`` (packages ``munge``, ``slurmctld``,
``slurmd``, ``slurm-client``; ``slurm-wlm`` pulls them in) as root, every file of theirs under
DIR: its own munge key and socket, ``slurm.conf`` (one node, this host with its CPUs, one
partition ``debug``, ``KillWait=30``: a preempted run has 30 s between SIGTERM and SIGKILL to
save), state, spool, pid and log files, on two free ports. Nothing under /etc is read or
written, so it does not disturb a Slurm already installed here. Clients (``sbatch``,
``squeue``...) find it through ``SLURM_CONF=DIR/slurm.conf``.

``Cluster.start`` raises ``Unavailable`` saying why when it cannot run (not root, a
binary missing, a daemon that does not come up: its log's last lines are in the message).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BINARIES = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client", "squeue": "slurm-client", "sinfo": "slurm-client",
            "scontrol": "slurm-client", "scancel": "slurm-client", "srun": "slurm-client"}
"""The programs used, and the Debian package of each (all pulled in by ``slurm-wlm``)."""
PARTITION = "debug"
KILL_WAIT_S = 30
CRED_EXPIRE_S = 5
"""Slurm's job credential lifetime, 120 s by default, is also how long a requeued job waits
before it may start again (its BeginTime): 5 s here, the least Slurm accepts, so that a test
sees it come back soon (a step's credential is checked within a second of being made)."""


class Unavailable(RuntimeError):
    """The cluster cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}")
                                       if os.access(p, os.X_OK)), None)


class Cluster:
    """The daemons' processes and files, all under ``root``."""

    def __init__(self, root: Path, cpus: int | None = None, kill_wait_s: int = KILL_WAIT_S):
        self.root = Path(root).resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: dict[str, subprocess.Popen] = {}

    # -- start ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> "Cluster":
        if os.geteuid() != 0:
            raise Unavailable("Slurm's daemons run as root here (slurmd starts jobs as their "
                              "user), and this process is not root")
        missing = [f"{b} (package {p})" for b, p in BINARIES.items() if not _which(b)]
        if missing:
            raise Unavailable(f"missing {', '.join(missing)}: `apt-get install slurm-wlm munge` "
                              f"(bash scripts/setup.sh test does it as root)")
        self.root.mkdir(parents=True, exist_ok=True)
        for d in ("state", "spool", "munge"):
            (self.root / d).mkdir(exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        try:
            self._start_munge()
            self.conf.write_text(self._slurm_conf())
            self._daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._daemon("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def _start_munge(self) -> None:
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            made = subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key)],
                                  capture_output=True, text=True)
            if made.returncode != 0:  # older munge: no mungekey; any 1 KiB of randomness does
                key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = self.root / "munge" / "munge.socket"
        self._daemon("munged", [_which("munged"), "--foreground", "--force",
                                f"--key-file={key}", f"--socket={self.socket}",
                                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                                f"--log-file={self.root / 'munged.log'}"])
        deadline = time.monotonic() + 15
        while not self.socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise Unavailable(f"munged did not open {self.socket}: {self._log('munged')}")
            time.sleep(0.1)

    def _slurm_conf(self) -> str:
        r = self.root
        return f"""# written by scripts/slurm/local_cluster.py
ClusterName=paratrain
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PreemptType=preempt/none
MpiDefault=none
ReturnToService=2
KillWait={self.kill_wait_s}
MinJobAge=600
JobRequeue=1
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def _daemon(self, name: str, argv: list[str]) -> None:
        out = open(self.root / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def _check_alive(self) -> None:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                raise Unavailable(f"{name} exited with status {proc.returncode}: {self._log(name)}")

    def _log(self, name: str, lines: int = 8) -> str:
        text = ""
        for path in (self.root / f"{name}.log", self.root / f"{name}.out"):
            if path.exists():
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no log)"

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            self._check_alive()
            state = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise Unavailable(f"the node is not idle after {timeout_s:g} s (sinfo: {state or 'no answer'}); "
                          f"slurmctld: {self._log('slurmctld', 4)}; slurmd: {self._log('slurmd', 4)}")

    # -- use -----------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        done = subprocess.run(argv, env={**self.env, **kwargs.pop("env", {})}, capture_output=True,
                              text=True, timeout=kwargs.pop("timeout", 60), **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def submit(self, *argv: str, env: dict | None = None, cwd: str | None = None) -> str:
        """``sbatch --parsable ARGV``; returns the job id."""
        return self.run("sbatch", "--parsable", *argv, env=env or {}, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts...); {} once purged."""
        done = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields = {}
        for item in done.stdout.split():
            key, eq, value = item.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                         "OUT_OF_MEMORY", "PREEMPTED"), timeout_s: float = 300) -> dict:
        """Poll until the job is in one of ``states``; its fields."""
        deadline = time.monotonic() + timeout_s
        fields = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s:g} s: {fields}")

    # -- stop ----------------------------------------------------------------------------
    def stop(self, remove: bool = True) -> None:
        """Cancel every job, stop the daemons (those this object started) and whatever they
        left (a job step's slurmstepd), remove ``root``."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            # down first: a job requeued while it is cancelled (a broken batch script) stays pending
            self.run("scontrol", "update", f"PartitionName={PARTITION}", "State=DOWN", check=False, timeout=20)
            deadline = time.monotonic() + self.kill_wait_s + 15
            while time.monotonic() < deadline:
                self.run("scancel", "--partition", PARTITION, check=False, timeout=20)
                if not self.run("squeue", "-h", check=False, timeout=20).stdout.strip():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        kill_leftovers(self.conf)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def kill_leftovers(conf: Path) -> list[int]:
    """SIGKILL what this cluster's slurmd left behind once it is stopped: each slurmstepd
    (it carries ``SLURM_CONF=conf`` from slurmd's environment) and its processes (a batch
    script, a job's tasks)."""
    mark, stepds = f"SLURM_CONF={conf}".encode(), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/comm", "rb") as f:
                if not f.read().startswith(b"slurmstepd"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    stepds.append(int(entry))
        except OSError:
            pass
    doomed = list(stepds)
    for pid in doomed:  # grows as children are found
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    doomed += [int(c) for c in f.read().split() if int(c) not in doomed]
        except OSError:
            pass
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return doomed


def _pids(root: Path) -> dict[str, int]:
    found = {}
    for name, path in (("slurmd", root / "slurmd.pid"), ("slurmctld", root / "slurmctld.pid"),
                       ("munged", root / "munge" / "munged.pid")):
        try:
            found[name] = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: local_cluster.py start|stop DIR", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "start":
        try:
            cluster = Cluster(root).start()
        except Unavailable as exc:
            print(f"local_cluster: cannot start: {exc}", file=sys.stderr)
            return 1
        for proc in cluster.daemons.values():  # leave them running after this process
            proc.returncode = 0
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    conf = root / "slurm.conf"
    if conf.exists():
        subprocess.run(["scancel", "--partition", PARTITION], env={**os.environ, "SLURM_CONF": str(conf)},
                       capture_output=True)
    pids = _pids(root)
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists()
                                               and not Path(f"/proc/{p}/stat").read_text().split(") ")[-1].startswith("Z")
                                               for p in pids.values()):
        time.sleep(0.2)
    kill_leftovers(conf)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
