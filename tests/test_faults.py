"""Faults end in a named, prompt failure, never a hang, an orphan, a leak or bad data.

Each world is tiny (2 ranks, the tiny model, a timeout of a few seconds). Faults that need
a real launcher (signals to ranks or to the launcher) run the CLI in a subprocess; the
others run in one spawned world or in-process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_world
from paratrain.cli import main
from paratrain.train.rundir import RunDirLock
from paratrain.watchdog import HEARTBEAT, Watchdog
from helpers import TINY, tiny_config

TIMEOUT_S = 4


def start(background, tmp: Path, run_dir: Path, *extra: str, ignore_sigint: bool = False) -> subprocess.Popen:
    """`paratrain train` in the background, its temporary files under ``tmp``."""
    def child() -> None:
        # SIG_IGN as a job started with `&` from a script; else the default, whatever this
        # pytest inherited (a suite run in the background ignores SIGINT, and so would the run)
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    return background([sys.executable, "-m", "paratrain", "train", *TINY, "--run-dir", str(run_dir), *extra],
                      env={**os.environ, "TMPDIR": str(tmp)}, preexec_fn=child,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps within {timeout_s} s")


def rank_pids(launcher: int) -> list[int]:
    """The launcher's rank processes, in rank order (started one after another)."""
    children = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        children += Path(f"/proc/{launcher}/task/{task}/children").read_text().split()
    ranks = sorted(int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
    assert len(ranks) == 2, ranks
    return ranks


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def leftovers(tmp: Path) -> list[str]:
    """The launcher's files (its scratch directory in the run directory, or the system's
    temporary one) and torch's error files, anywhere under ``tmp``."""
    return [p.name for p in tmp.rglob("*") if p.name.startswith(("paratrain-", ".launch-", "pytorch-errorfile"))]


# ---- hangs and dead ranks --------------------------------------------------------------------
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(tmp_path, background):
    proc = start(background, tmp_path, tmp_path / "run", "--steps", "100000", "--timeout-s", str(TIMEOUT_S))
    wait_for_steps(proc, tmp_path / "run" / "metrics.jsonl", 2)
    ranks = rank_pids(proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - stopped
    assert proc.returncode == 1, err
    assert elapsed < TIMEOUT_S + 30, f"took {elapsed:.1f} s"  # a wide margin: machines differ 3x
    assert f"rank 1 (pid {ranks[1]}) is stopped" in err  # the launcher sees it
    assert "did not arrive: rank 1 (silent for" in err  # and so do its peers, from heartbeats
    assert "hang at step" in err and "Traceback" not in err
    assert not any(alive(pid) for pid in ranks) and not leftovers(tmp_path)


def test_a_killed_rank_ends_the_job_at_once_naming_it(tmp_path, background):
    proc = start(background, tmp_path, tmp_path / "run", "--steps", "100000", "--timeout-s", "60")
    wait_for_steps(proc, tmp_path / "run" / "metrics.jsonl", 2)
    ranks = rank_pids(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and time.monotonic() - killed < 30, err
    assert err.startswith("paratrain train: rank 1 was killed by SIGKILL"), err
    assert not any(alive(pid) for pid in ranks) and not leftovers(tmp_path)


class FakeStore(dict):
    def set(self, key, value):
        self[key] = value

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, key):
        return self[key].encode()


def test_the_watchdog_reports_a_wait_stuck_past_the_timeout_and_nothing_else():
    reports = []
    store = FakeStore()
    dog = Watchdog(rank=0, timeout_s=0.5, on_hang=reports.append).start()
    dog.attach(store)
    try:
        time.sleep(1.5)  # computing, not waiting on a collective: no report
        assert reports == [] and HEARTBEAT + "0" in store
        start = time.monotonic()
        while not reports and time.monotonic() - start < 10:
            time.sleep(0.5)  # stands in for work.wait() on a collective that never completes
    finally:
        dog.stop()
    assert reports and time.monotonic() - start < 8, reports
    assert reports[0].startswith("hang at step ?: rank 0 waited") and "(--timeout-s 0.5)" in reports[0]


# ---- the launcher's end, and one run per directory ---------------------------------------------
def test_ctrl_c_leaves_nothing_behind_and_runs_do_not_share_a_directory(tmp_path, background):
    run_dir = tmp_path / "run"
    first = start(background, tmp_path, run_dir, "--steps", "100000")
    wait_for_steps(first, run_dir / "metrics.jsonl", 2)
    ranks = rank_pids(first.pid)
    assert main(["train", *TINY, "--steps", "2", "--run-dir", str(run_dir)]) == 2  # refused
    first.send_signal(signal.SIGINT)  # Ctrl-C
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130 and err.strip().splitlines()[-1].endswith("interrupted (Ctrl-C); stopped")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not any(alive(pid) for pid in ranks) and not leftovers(tmp_path)
    assert not (run_dir / ".lock").exists()


def test_a_killed_launchers_ranks_end_and_its_lock_is_taken_over(tmp_path, background):
    run_dir = tmp_path / "run"
    second = start(background, tmp_path, run_dir, "--steps", "100000", ignore_sigint=True)
    wait_for_steps(second, run_dir / "metrics.jsonl", 2)
    ranks = rank_pids(second.pid)
    second.kill()
    second.communicate(timeout=30)
    deadline = time.monotonic() + 90  # a bound on the wait, not a speed claim
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)
    RunDirLock(tiny_config(str(run_dir), nproc=2)).acquire().release()  # stale lock taken over
    deadline = time.monotonic() + 20  # a bound on the wait, not a speed claim
    while leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The launcher's death signal comes once per launcher thread that held the ranks; as
    # SIGTERM, the loop's preemption handler took the second for "stop now" and skipped this.
    assert not leftovers(tmp_path)


def where_inside_a_wrapped_collective() -> dict:
    """``watchdog._where`` of a main thread inside a subgroup collective that torch wraps
    (torch 2.13: ``c10d_logger.wrapper`` -> ``all_reduce``), frames built to look like torch's."""
    from paratrain.watchdog import _where

    torch_code: dict = {}
    exec(compile("def wrapper(fn, *args, **kwargs):\n    return fn(*args, **kwargs)\n",
                 "/site-packages/torch/distributed/c10d_logger.py", "exec"), torch_code)
    exec(compile("def all_reduce(tensor, op=None, group=None, here=None):\n    return here()\n",
                 "/site-packages/torch/distributed/distributed_c10d.py", "exec"), torch_code)
    group = dist.new_group([0])
    frame = torch_code["wrapper"](torch_code["all_reduce"], None, group=group, here=sys._getframe)
    return {"where": _where(frame), "name": dist.distributed_c10d._world.pg_names[group]}


def test_a_hang_inside_a_wrapped_collective_names_its_group():
    """Every torch 2.13 collective runs inside a wrapper frame without ``group``: the report
    blamed the world group, and called every peer "waiting too"."""
    got = run_world(where_inside_a_wrapped_collective, 1)[0]
    assert (got["where"]["call"], got["where"]["group"]) == ("all_reduce", got["name"]), got
    assert got["name"] != "0"


def exit_quietly(code: int) -> None:
    """Rank 1 leaves with ``code`` and no exception; rank 0 then waits for it in a collective."""
    if dist.get_rank() == 1:
        os._exit(code)
    time.sleep(0.5)
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("code", [3, 0])
def test_a_rank_that_exits_without_an_error_is_named(code):
    """Before, the report blamed rank 0 with a gloo 'Connection reset by peer' traceback."""
    from paratrain.launch import RankFailed

    with pytest.raises(RankFailed) as failed:
        run_world(exit_quietly, 2, code, timeout_s=60)
    assert str(failed.value).startswith(f"rank 1 exited with code {code} while its peers were running")


def test_the_step_of_a_hang_is_the_loops_not_a_helpers():
    """A hang inside ``_save(run, step)`` (whose ``step`` already counts from 1) was reported
    one step late; the step is read from the loop's ``train`` frame only."""
    from paratrain.watchdog import _where

    loop: dict = {}
    exec(compile("def train(here):\n    step = 1\n    return _save(here, step + 1)\n"
                 "def _save(here, step):\n    return here()\n",
                 "/site-packages/paratrain/train/loop.py", "exec"), loop)
    assert _where(loop["train"](sys._getframe))["step"] == 2


def test_a_rank_that_never_joins_is_named_without_a_torch_traceback(tmp_path, monkeypatch):
    """A rank stuck before the rendezvous made its peers fail in init_process_group with
    torch's "Wait timeout" traceback, naming no rank."""
    from paratrain import launch

    def timeout(spec):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Wait timeout")

    monkeypatch.setattr(launch, "init_world", timeout)
    with pytest.raises(launch.JoinError, match=r"^rank 0 could not join the world of 2 within 5 s "
                                               r"\(--timeout-s\): .*Wait timeout$"):
        launch.enter_world(launch.WorldSpec(0, 2, 0, "gloo", "file:///none", 5.0))

    class Alive:  # a rank process still running (this one: not stopped)
        exitcode, pid = None, os.getpid()

    (tmp_path / "joining0").touch()
    (tmp_path / "error0.txt").write_text(f"{time.time()}\nJoinError: rank 0 could not join ...")
    report = launch._failure_report([Alive(), Alive()], str(tmp_path))
    assert report.startswith("rank 1 never reached the process group's rendezvous"), report


# ---- restarts and exports that must not touch another run's work ----------------------------

def test_a_restarted_torchrun_job_continues_its_own_run_not_latest(tmp_path, monkeypatch):
    """Job A (no --run-dir) is killed; job B, started later in the same directory, moves
    runs/latest and finishes. A's restart must resume A's own checkpoint, not B's run."""
    from test_runs import config, fake_checkpoint

    from paratrain.launch import job_identity
    from paratrain.train import runs

    monkeypatch.chdir(tmp_path)
    cfg = config(save_every=2)
    a, b = (job_identity(run_id, 4242) for run_id in ("none", "jobB"))  # A: torchrun's default id
    first, _ = runs.place(cfg, torchrun=True, now=0, job=runs.Job(a))
    fake_checkpoint(Path(first.train.run_dir), 4, cfg, run_id="A")
    other, notes = runs.place(config(resume="none", steps=4), torchrun=True, now=60, job=runs.Job(b))
    fake_checkpoint(Path(other.train.run_dir), 4, cfg, run_id="B")
    assert os.readlink("runs/latest") == Path(other.train.run_dir).name  # B moved latest

    restarted, notes = runs.place(cfg, torchrun=True, now=120, job=runs.Job(a, attempt=1))
    assert restarted.train.run_dir == first.train.run_dir, notes
    assert Path(restarted.train.resume) == Path(first.train.run_dir) / "checkpoints" / "step-4"
    # B's own restart (its first attempt resumed nothing) continues B, from its checkpoint
    again, _ = runs.place(config(resume="none", steps=6), torchrun=True, now=180, job=runs.Job(b, attempt=1))
    assert again.train.run_dir == other.train.run_dir and again.train.resume.endswith("step-4")
    # a restart whose first attempt recorded nothing starts anew, never in latest
    lost, notes = runs.place(cfg, torchrun=True, now=240, job=runs.Job("agent-elsewhere", attempt=2))
    assert lost.train.run_dir not in (first.train.run_dir, other.train.run_dir) and not lost.train.resume
    assert "recorded no run directory" in notes[0]


def test_the_job_identity_is_torchruns_run_id_or_else_its_agent(tmp_path):
    from paratrain.launch import job_identity

    assert job_identity("slurm-1234", os.getpid()) == "rdzv-slurm-1234"
    agent = job_identity("none", os.getpid())
    assert agent == job_identity("", os.getpid()) and str(os.getpid()) in agent
    assert agent != job_identity("none", os.getppid())  # another agent, another job


def test_export_overwrite_touches_only_plain_names_inside_the_directory(tmp_path):
    """A Hugging Face index naming '../victim' or an absolute path must delete nothing
    outside --out: the export is refused before any weight is read or file removed."""
    import json

    from paratrain.models import hf

    victims = [tmp_path / "victim.txt", tmp_path / "abs.txt"]
    out = tmp_path / "model"
    out.mkdir()
    for victim in victims:
        victim.write_text("keep me")
    (out / "model-1.safetensors").write_text("old shard")
    for bad in ("../victim.txt", str(victims[1]), "sub/../../victim.txt"):
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"a": "model-1.safetensors", "b": bad}}))
        with pytest.raises(hf.HFModelError, match="plain file name"):
            hf.check_export_target(out, overwrite=True)
        with pytest.raises(hf.HFModelError, match="plain file name"):
            hf.weight_files(out)  # nor is any such file read
    assert all(v.read_text() == "keep me" for v in victims) and (out / "model-1.safetensors").exists()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": 5}))
    with pytest.raises(hf.HFModelError, match="weight_map"):
        hf.weight_files(out)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    hf.check_export_target(out, overwrite=True)
    hf._remove_shards(out)  # a plain name inside the directory is what --overwrite replaces
    assert not (out / "model-1.safetensors").exists() and all(v.exists() for v in victims)


def test_a_lock_is_taken_over_by_a_restart_of_its_job_or_when_its_pid_was_reused(tmp_path):
    """A requeued job (same torchrun run id, another node) takes over its own lock; a lock
    whose pid now belongs to another process (a container restart) is stale; any other
    live holder is refused."""
    import json
    import socket

    from helpers import tiny_config

    from paratrain.train.rundir import RunDirError

    cfg = tiny_config(str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    lock = tmp_path / "run" / ".lock"
    elsewhere = {"pid": 4242, "host": "node07", "since": 0.0, "job": "rdzv-1234"}
    lock.write_text(json.dumps(elsewhere))
    with pytest.raises(RunDirError, match="pid 4242 on node07"):
        RunDirLock(cfg, job="rdzv-9999").acquire()
    RunDirLock(cfg, job="rdzv-1234").acquire().release()  # the same job, restarted: taken over
    reused = {"pid": os.getpid(), "host": socket.gethostname(), "since": 0.0, "start": "1"}
    lock.write_text(json.dumps(reused))  # our pid, but not the process that wrote the lock
    RunDirLock(cfg).acquire().release()
    lock.write_text(json.dumps({**reused, "start": ""}))  # a live pid, no start recorded: in use
    with pytest.raises(RunDirError, match="in use"):
        RunDirLock(cfg).acquire()


def test_a_torchrun_job_ended_by_sigterm_releases_its_lock(tmp_path, background):
    """Slurm and Kubernetes stop a job with SIGTERM; rank 0 used to end through os._exit and
    leave RUN_DIR/.lock, so the requeued job was refused until a human removed it."""
    from test_launch import free_port

    run = tmp_path / "run"
    job = background([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                      "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                      f"localhost:{free_port()}", "-m", "paratrain", "train", *TINY[:-2],
                      "--steps", "100000", "--run-dir", str(run)],
                     cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)},
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_steps(job, run / "metrics.jsonl", 2)
    assert (run / ".lock").is_file()
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    assert job.returncode != 0, output
    assert not (run / ".lock").exists(), output[-3000:]


def test_a_checkpoint_index_is_checksummed_confined_and_checked_field_by_field(tmp_path):
    """meta.json is input: a changed digit, a file named outside the checkpoint, a negative
    or fractional counter, or a dtype that is not the file's are each refused by name
    before launch (they resumed 8 steps late, read other files, crashed after spawn, or
    were cast silently)."""
    import json

    from test_runs import config, fake_checkpoint

    from paratrain.train import checkpoint, publish

    cfg = config()
    path = fake_checkpoint(tmp_path, 20, cfg)
    index = path / checkpoint.INDEX
    good = json.loads(index.read_text())
    checkpoint.verify(path, cfg.model)

    def with_index(meta: dict, sealed: bool = True) -> None:
        index.write_text(json.dumps(publish.seal(meta) if sealed else
                                    {k: v for k, v in meta.items() if k != publish.SEAL}))

    index.write_text(index.read_text().replace('"step": 20', '"step": 28', 1))
    with pytest.raises(checkpoint.CheckpointError, match="changed after it was written"):
        checkpoint.read_meta(path)
    for bad, field in (({"step": -5}, "step"), ({"step": 2.5}, "step"), ({"step": True}, "step"),
                       ({"data": {**good["data"], "samples_seen": -1}}, "data.samples_seen")):
        with_index({**good, **bad}, sealed=False)  # an index from before the checksum, edited
        with pytest.raises(checkpoint.CheckpointError, match=rf"{re.escape(field)} is .*not a count"):
            checkpoint.read_meta(path)
    (name, info), = good["files"].items()
    for outside in ("../victim.safetensors", str(tmp_path / "victim.safetensors")):
        slices = {k: {**v, "slices": [{**s, "file": outside} for s in v["slices"]]}
                  for k, v in good["tensors"].items()}
        with_index({**good, "files": {outside: info}, "tensors": slices})
        with pytest.raises(checkpoint.CheckpointError, match="not a plain file name"):
            checkpoint.read_meta(path)
    key = next(iter(good["tensors"]))
    with_index({**good, "tensors": {**good["tensors"], key: {**good["tensors"][key], "dtype": "bfloat16"}}})
    with pytest.raises(checkpoint.CheckpointError, match="stores slice .* as F32, its index says bfloat16"):
        checkpoint.verify(path, cfg.model)
    with_index(good)
    checkpoint.verify(path, cfg.model)  # the untouched index, resealed, still verifies


def test_a_full_disk_outside_checkpoints_is_named_and_leaves_strict_records(tmp_path, monkeypatch):
    """ENOSPC in the metrics append left a torn line, and in claim_records a 0-byte
    .run.json.tmp, each with a raw traceback."""
    import json

    from paratrain.errors import RunError
    from paratrain.train.metrics import MetricsWriter
    from paratrain.train.rundir import claim_records

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": 2.0})
    real = writer._file

    class Full:  # half the line reaches the disk, then the disk is full
        def write(self, text):
            real.write(text[:len(text) // 2])
            real.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(real, name)

    writer._file = Full()
    with pytest.raises(RunError, match=r"metrics.jsonl at step 2: No space left on device.*--resume auto"):
        writer.write({"step": 2, "loss": 1.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]  # strict
    writer.write({"step": 3})  # nothing more is written, nothing raises twice
    writer.close()

    def full(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(RunError, match=r"run.json: No space left on device; free space"):
        claim_records(tmp_path, "r1")
    assert not list(tmp_path.glob(".run.json*"))


def test_a_torn_non_utf8_metrics_tail_resumes_and_reports(tmp_path):
    """A power loss can leave bytes that are not UTF-8 at the end of metrics.jsonl:
    --resume auto (keep_records_until) and report crashed on them, a crash loop under
    torchrun's restarts."""
    from paratrain.report import read_metrics
    from paratrain.train.metrics import keep_records_until

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo\xff\xfe')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    keep_records_until(path, 2)
    assert path.read_bytes() == b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'


def test_the_launchers_scratch_lives_in_the_run_directory_and_its_loss_is_named(tmp_path, background):
    """It lived in the system's temporary directory: a cleaner that removed it ended the run
    with a bare "[Errno 2] No such file or directory"."""
    import shutil

    run = tmp_path / "run"
    proc = start(background, tmp_path, run, "--steps", "100000", "--timeout-s", "30")
    wait_for_steps(proc, run / "metrics.jsonl", 2)
    scratch = list(run.glob(".launch-*"))
    assert len(scratch) == 1 and not list(tmp_path.glob("paratrain-*"))  # the run owns it
    shutil.rmtree(scratch[0])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert f"the launcher's scratch directory {scratch[0]} was removed while the run was going" in err, err
    assert "Traceback" not in err and "Errno 2" not in err, err


def test_a_failed_run_names_its_last_checkpoint_and_a_resume_command_that_works(tmp_path, background):
    """A killed run said neither which checkpoint is the last complete one nor how to go on;
    --keep-last 2 keeps the disk from filling with the rest."""
    import shlex

    run = tmp_path / "run"
    proc = start(background, tmp_path, run, "--steps", "100000", "--save-every", "2", "--keep-last", "2",
                 "--timeout-s", "30")
    wait_for_steps(proc, run / "metrics.jsonl", 7)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    published = sorted(p.name for p in (run / "checkpoints").glob("step-*") if (p / "meta.json").is_file())
    # --keep-last 2: a kill between publishing a checkpoint and pruning the oldest leaves 3
    # (publish first, so that never fewer than 2 complete ones exist)
    assert 1 <= len(published) <= 3, published
    newest = max(published, key=lambda n: int(n[5:]))
    assert f"last complete checkpoint: {run / 'checkpoints' / newest}; continue with `" in err, err
    command = shlex.split(err.split("continue with `")[1].split("`")[0])
    step = int(newest[5:])
    done = subprocess.run([sys.executable, "-m", *command[:1], *command[1:], "--steps", str(step + 2),
                           "--no-progress"], env={**os.environ, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming {run / 'checkpoints' / newest} (step {step})" in done.stdout, done.stdout[-2000:]


def test_a_nonfinite_message_says_which_of_loss_and_norm_was_not_finite():
    from paratrain.train.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard("stop", 0)
    norm = guard.check({"loss": 5.545, "grad_norm": float("nan"), "step": 3, "nonfinite_ranks": []}, "")
    assert str(norm).startswith("non-finite grad norm nan (the loss 5.545 is finite) at step 3"), norm
    both = guard.check({"loss": float("nan"), "grad_norm": float("inf"), "step": 3, "nonfinite_ranks": [1]}, "")
    assert str(both).startswith("non-finite loss nan and grad norm inf at step 3 on rank 1"), both


def test_a_rank_that_fails_after_a_killed_one_is_not_said_to_fail_first(tmp_path):
    from types import SimpleNamespace

    from paratrain.launch import _failure_report

    (tmp_path / "error1.txt").write_text("12.5\nConnectionResetError: peer gone\n")
    (tmp_path / "joining0").touch()
    (tmp_path / "joining1").touch()
    procs = [SimpleNamespace(exitcode=-9, pid=1), SimpleNamespace(exitcode=1, pid=2)]
    report = _failure_report(procs, str(tmp_path))
    assert report.startswith("rank 0 was killed by SIGKILL"), report
    assert "failed first" not in report and "rank 1 then failed" in report, report


def test_a_token_id_beyond_the_vocabulary_is_named_with_its_shard_and_position(tmp_path):
    """A damaged shard crashed at the step that read it with a 70-line IndexError naming
    neither the dataset, the shard nor `data verify` (and again after every restart)."""
    import numpy as np

    from paratrain.data.dataset import load_split
    from paratrain.data.prepare import prepare
    from paratrain.train.data import Samples, TokenIdError

    (tmp_path / "text.txt").write_text("the cat sat on the mat\n" * 200)
    prepare([str(tmp_path / "text.txt")], "bytes", str(tmp_path / "data"))
    shard = next((tmp_path / "data").glob("*.bin"))
    tokens = np.memmap(shard, dtype=np.uint16, mode="r+")
    tokens[1000] = 999  # a flipped bit's worth of damage
    tokens.flush()
    train, _, _ = load_split(tmp_path / "data")
    samples = Samples(train, 32, vocab_size=256, source=str(tmp_path / "data"))
    samples.batch([0, 1])  # clean samples read as before
    with pytest.raises(TokenIdError) as info:
        samples.batch([30, 31])  # tokens 960..1024 hold the damage
    message = str(info.value)
    assert f"{shard.name} at token 1,000 holds token id 999, beyond the model's vocabulary of 256" in message
    assert f"paratrain data verify {tmp_path / 'data'}" in message


def test_a_lost_link_is_named_by_address_and_ranks():
    """netfault: gloo's broken connection, and a hang whose silent peers are all on another
    node (or whose store cannot be reached at all), become one line naming the node."""
    from paratrain import netfault

    addresses = ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.77.0.2]:1452: "
                               "Connection reset by peer. GLHF!")
        except RuntimeError as inner:
            raise RuntimeError("pipeline rank 0 failed at 0B1") from inner
    except RuntimeError as exc:
        line = netfault.describe_lost_link(exc, addresses, 0)
    assert line == "rank 0 lost the network link to 10.77.0.2 (ranks 2, 3): connection reset by peer"
    assert netfault.describe_lost_link(ValueError("shapes differ"), addresses, 0) is None
    assert "ranks 2, 3 at 10.77.0.2 are unreachable from 10.77.0.1" in netfault.unreachable([2, 3], addresses, 1)
    assert netfault.unreachable([1, 2], addresses, 0) is None  # a peer on this node: not the link
    assert "the store on 10.77.0.1 (rank 0's node) is unreachable from 10.77.0.2" in netfault.unreachable(
        [0, 1, 3], addresses, 2, store_lost=True)
