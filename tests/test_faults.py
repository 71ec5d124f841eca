"""Faults end in a named, prompt failure, never a hang, an orphan, a leak or bad data.

Each world is tiny (2 ranks, the tiny model, a timeout of a few seconds). Faults that need
a real launcher (signals to ranks or to the launcher) run the CLI in a subprocess; the
others run in one spawned world or in-process.
"""

from __future__ import annotations

import errno
import json
import math
import os
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
from paratrain.mesh import Mesh
from paratrain.models.gpt import GPT, PRESETS
from paratrain.train import checkpoint, loop
from paratrain.train.rundir import RunDirError, RunDirLock
from paratrain.watchdog import HEARTBEAT, Watchdog
from helpers import tiny_config

TINY = ["--model", "tiny", "--seq-len", "32", "--eval-every", "0", "--no-progress", "--nproc", "2"]
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
    return [p.name for p in tmp.iterdir() if p.name.startswith(("paratrain-", "pytorch-errorfile"))]


def strict_json(path: Path) -> list[dict]:
    def refuse(token):
        raise AssertionError(f"{path} holds {token}, which strict JSON rejects")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


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
    assert elapsed < TIMEOUT_S + 10, f"took {elapsed:.1f} s"
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
    assert proc.returncode == 1 and time.monotonic() - killed < 10, err
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
        while not reports and time.monotonic() - start < 5:
            time.sleep(0.5)  # stands in for work.wait() on a collective that never completes
    finally:
        dog.stop()
    assert reports and time.monotonic() - start < 3, reports
    assert reports[0].startswith("hang at step ?: rank 0 waited") and "(--timeout-s 0.5)" in reports[0]


# ---- the launcher's end, and one run per directory ---------------------------------------------
def test_ctrl_c_and_a_killed_launcher_leave_nothing_behind_and_runs_do_not_share_a_directory(tmp_path, background):
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

    (run_dir / "metrics.jsonl").unlink()  # wait for the second run's own steps
    second = start(background, tmp_path, run_dir, "--steps", "100000", ignore_sigint=True)
    wait_for_steps(second, run_dir / "metrics.jsonl", 2)
    ranks = rank_pids(second.pid)
    second.kill()
    second.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) or leftovers(tmp_path):
        assert time.monotonic() < deadline, (ranks, leftovers(tmp_path))
        time.sleep(0.1)
    RunDirLock(tiny_config(str(run_dir), nproc=2)).acquire().release()  # stale lock taken over


def test_a_fresh_run_never_overwrites_another_runs_checkpoints(tmp_path):
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    assert main(["train", *TINY, "--steps", "3", "--save-every", "3", "--run-dir", str(tmp_path)]) == 2
    # and under the lock, where a torchrun job's `--resume auto` arrives once rank 0 placed it
    with pytest.raises(RunDirError, match="holds checkpoints of another run"):
        RunDirLock(tiny_config(str(tmp_path), nproc=2, steps=3, save_every=3)).acquire()
    assert not (tmp_path / ".lock").exists()  # refused: no lock left behind


def test_a_read_only_run_directory_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    if os.geteuid() != 0:
        read_only.chmod(0o555)
    else:  # root writes anywhere: make the file system say it is read-only
        real_open = os.open

        def refuse(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    assert main(["train", *TINY, "--steps", "2", "--run-dir", str(read_only)]) == 2
    assert "cannot write to the run directory" in capsys.readouterr().err


# ---- numbers -----------------------------------------------------------------------------------
def test_a_nan_loss_stops_the_run_naming_step_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--steps", "30",
                           "--lr", "1e6", "--warmup-steps", "0", "--save-every", "1", "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    records = strict_json(run_dir / "metrics.jsonl")
    bad = records[-1]
    assert bad["loss"] is None or bad["grad_norm"] is None
    assert f"at step {bad['step']}" in done.stderr and "Traceback" not in done.stderr
    last_good = run_dir / "checkpoints" / f"step-{bad['step'] - 1}"
    assert f"Last good checkpoint: {last_good}" in done.stderr
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == bad["step"] - 1  # the bad step was never saved
    _, tensors = checkpoint.verify(saved[-1], PRESETS["tiny"])
    assert all(torch.isfinite(t).all() for t in tensors.values())


def poisoned(build, at_calls: set[int]):
    """``loop.build`` whose model returns a NaN loss on rank 1 at the given forward calls
    (the engine's step runs the chunk, here the whole model)."""
    def patched(cfg, mesh):
        run = build(cfg, mesh)
        chunk = run.engine.plan.chunks[-1]
        forward, calls = chunk.forward, [0]

        def forward_nan(*args, **kwargs):
            calls[0] += 1
            loss = forward(*args, **kwargs)
            return loss * float("nan") if calls[0] in at_calls and dist.get_rank() == 1 else loss

        chunk.forward = forward_nan
        return run
    return patched


def failing_write(kind: str):
    """A ``save_file`` that half-writes and finds the disk full, one that fails on rank 1
    only with an error no file system gives, or a read-only ``mkdir``."""
    real_save = checkpoint.save_file

    def save_file(tensors, path):
        if kind == "rank 1 only":
            if dist.get_rank() == 1:
                raise RuntimeError("out of memory copying to the host")
            return real_save(tensors, path)
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if "checkpoints" not in str(self):  # the metrics file is written elsewhere
            return real_mkdir(self, *args, **kwargs)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    return mkdir if kind == "read-only" else save_file


def faults_in_one_world(tmp: str) -> dict:
    mesh = Mesh.build(tiny_config(tmp, nproc=2).layout)
    out = {"timeouts": [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                        for g in mesh.groups.values() if dist.get_world_size(g) > 1]}
    build = loop.build
    # skip: the step is not applied, counted, and the run goes on (one skip allowed)
    loop.build = poisoned(build, {2})
    cfg = tiny_config(f"{tmp}/skip", nproc=2, steps=5, eval_every=0, on_nonfinite="skip",
                      max_skips=1, save_every=3)
    result = loop.train(cfg, Mesh.build(cfg.layout), keep_params=True)
    out["skip_losses"], out["skip_params"] = result.losses, result.params
    # resumed after the skip: Adam's count excludes it (bias correction), and so does the budget
    loop.build = build
    resumed = dict(nproc=2, steps=5, eval_every=0, on_nonfinite="skip", max_skips=1,
                   resume=f"{tmp}/skip/checkpoints/step-3")
    cfg = tiny_config(f"{tmp}/skip-resumed", **resumed)
    result = loop.train(cfg, Mesh.build(cfg.layout), keep_params=True)
    out["resumed_losses"], out["resumed_params"] = result.losses, result.params
    # a rank that cannot read its boxes: every rank fails, none waits in a collective
    real_fill = checkpoint.Reader.fill

    def fill(self, piece):
        if dist.get_rank() == 1:
            raise RuntimeError("cannot decompress block")
        return real_fill(self, piece)
    checkpoint.Reader.fill = fill
    try:
        loop.train(tiny_config(f"{tmp}/load-fails", **resumed), mesh)
    except Exception as exc:  # noqa: BLE001
        out["load_fails"] = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint.Reader.fill = real_fill
    loop.build = poisoned(build, {1})
    cfg = tiny_config(f"{tmp}/skip-resumed-over", **resumed)
    try:
        loop.train(cfg, Mesh.build(cfg.layout))
    except Exception as exc:  # noqa: BLE001
        out["resumed_over"] = f"{type(exc).__name__}: {exc}"
    loop.build = poisoned(build, {2})
    # compressed: the skipped step's NaN must not stay in the residuals (or PowerSGD's Q)
    for method in ("int8", "powersgd:2", "topk:0.5"):
        cfg = tiny_config(f"{tmp}/skip-{method.replace(':', '_')}", nproc=2, steps=4,
                          eval_every=0, on_nonfinite="skip", max_skips=1, save_every=4,
                          compress=method, compress_start=0)
        try:
            out[method] = loop.train(cfg, Mesh.build(cfg.layout)).losses
        except Exception as exc:  # noqa: BLE001
            out[method] = f"{type(exc).__name__}: {exc}"
    for name, policy, steps in (("stop", "stop", {3}), ("over", "skip", {2, 3})):
        loop.build = poisoned(build, steps)
        cfg = tiny_config(f"{tmp}/{name}", nproc=2, steps=4, eval_every=0, on_nonfinite=policy,
                          max_skips=1, save_every=1)
        try:
            loop.train(cfg, Mesh.build(cfg.layout))
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    loop.build = build
    for kind in ("full", "read-only", "rank 1 only"):
        sharded = dict(zero=1, tie_embeddings=False) if kind == "rank 1 only" else {}  # rank 1 writes
        cfg = tiny_config(f"{tmp}/{kind}", nproc=2, steps=2, eval_every=0, save_every=2, **sharded)
        if kind != "read-only":
            checkpoint.save_file, real = failing_write(kind), checkpoint.save_file
        else:
            Path.mkdir, real = failing_write(kind), Path.mkdir
        try:
            loop.train(cfg, Mesh.build(cfg.layout))
        except Exception as exc:  # noqa: BLE001
            out[kind] = f"{type(exc).__name__}: {exc}"
        finally:
            if kind != "read-only":
                checkpoint.save_file = real
            else:
                Path.mkdir = real
    return out


def test_nonfinite_steps_and_failed_writes_in_one_world(tmp_path):
    got = run_world(faults_in_one_world, 2, str(tmp_path), timeout_s=240)
    for rank in (0, 1):
        out = got[rank]
        assert out["timeouts"] and set(out["timeouts"]) == {300.0}  # spawn's collective timeout
        assert torch.isnan(torch.tensor(out["skip_losses"][1])) and len(out["skip_losses"]) == 5
        assert out["resumed_losses"] == pytest.approx(out["skip_losses"][3:], rel=1e-6)
        for name, want in out["skip_params"].items():
            assert torch.allclose(out["resumed_params"][name], want, rtol=1e-5, atol=1e-7), name
        assert "over --max-skips 1" in out["resumed_over"] and "at step 4" in out["resumed_over"]
        assert "CheckpointError" in out["load_fails"], out["load_fails"]
        assert "cannot decompress block (on rank 1)" in out["load_fails"]
        for method in ("int8", "powersgd:2", "topk:0.5"):
            losses = out[method]
            assert isinstance(losses, list), (method, losses)
            assert math.isnan(losses[1]) and all(map(math.isfinite, losses[2:])), (method, losses)
        assert "NonFiniteError" in out["stop"] and "at step 3 on rank 1" in out["stop"], out["stop"]
        assert f"Last good checkpoint: {tmp_path / 'stop' / 'checkpoints' / 'step-2'}" in out["stop"]
        assert "over --max-skips 1" in out["over"] and "at step 3" in out["over"], out["over"]
        assert "CheckpointError" in out["full"] and "No space left on device" in out["full"], out["full"]
        assert "CheckpointError" in out["read-only"] and "Read-only file system" in out["read-only"]
        assert "CheckpointError: RuntimeError: out of memory" in out["rank 1 only"], out["rank 1 only"]
        assert "(on rank 1)" in out["rank 1 only"]  # every rank fails, none waits in the gather
    records = strict_json(tmp_path / "skip" / "metrics.jsonl")
    assert records[1]["loss"] is None and records[1]["skipped"] == 1 and records[1]["nonfinite_ranks"] == [1]
    meta, tensors = checkpoint.verify(tmp_path / "skip" / "checkpoints" / "step-5", PRESETS["tiny"])
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert meta["run"]["seed"] == 0 and meta["run"]["config"]["train"]["on_nonfinite"] == "skip"
    assert meta["data"]["step"] == 5 and meta["data"]["samples_seen"] == 5 * 8
    assert meta["nonfinite"]["skipped"] == 1
    assert strict_json(tmp_path / "stop" / "metrics.jsonl")[-1]["loss"] is None
    assert not (tmp_path / "stop" / "checkpoints" / "step-3").exists()
    assert list((tmp_path / "full" / "checkpoints").iterdir()) == []  # no half-written checkpoint


# ---- checkpoints ---------------------------------------------------------------------------------
def write_checkpoint(directory: Path, edit=None) -> Path:
    """A checkpoint of the tiny model (no training needed), optionally edited first."""
    torch.manual_seed(0)
    params = dict(GPT(PRESETS["tiny"]).named_parameters())
    tensors = {f"{kind}/{n}": (p.detach().clone() if kind == "param" else torch.zeros_like(p)).contiguous()
               for kind in checkpoint.KINDS for n, p in params.items()}
    if edit:
        edit(tensors)
    checkpoint.write(tensors, directory, {"format": checkpoint.FORMAT, "step": 2, "layout": "dp1",
                                          "model": __import__("dataclasses").asdict(PRESETS["tiny"])})
    return directory


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 400, len(data) - 384):  # inside the last tensors' data
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_partial_and_mismatched_checkpoints_are_refused_before_launch(tmp_path, capsys):
    name = "param/layers.0.attn.wq.weight"
    cases = {
        "flipped": (lambda d: flip_bytes(d / checkpoint.STATE), "checksum"),
        "truncated": (lambda d: (d / checkpoint.STATE).write_bytes((d / checkpoint.STATE).read_bytes()[:5000]),
                      "corrupt"),
        "no-state": (lambda d: (d / checkpoint.STATE).unlink(), "incomplete"),
        "no-meta": (lambda d: (d / "meta.json").unlink(), "no checkpoint"),
    }
    for case, (damage, message) in cases.items():
        ckpt = write_checkpoint(tmp_path / case)
        damage(ckpt)
        assert main(["train", *TINY, "--steps", "4", "--run-dir", str(tmp_path / "run"),
                     "--resume", str(ckpt)]) == 2, case
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (case, err)
    edits = {
        "missing": (lambda t: t.pop(name), f"lacks tensor {name!r}"),
        "extra": (lambda t: t.update({"param/bogus": torch.zeros(3)}), "'param/bogus', which this model"),
        "shape": (lambda t: t.update({name: torch.zeros(3, 3)}), f"{name!r} has shape [3, 3]"),
        "dtype": (lambda t: t.update({name: t[name].double()}), f"{name!r} has dtype float64"),
    }
    for case, (edit, message) in edits.items():
        ckpt = write_checkpoint(tmp_path / case, edit)
        with pytest.raises(checkpoint.CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            checkpoint.verify(ckpt, PRESETS["tiny"])
    with pytest.raises(checkpoint.CheckpointError, match="tensor 'exp_avg/.*' holds NaN"):
        write_checkpoint(tmp_path / "nan", lambda t: t[f"exp_avg/{name[6:]}"].fill_(float("nan")))
    assert not (tmp_path / "nan").exists() and not list(tmp_path.glob(".nan*"))


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
