"""Run directories and restarts without typing: where a run writes, what ``--resume auto``
picks, the records a run directory holds, metrics continued (not duplicated) on resume, and
a torchrun job whose rank is SIGKILLed coming back to finish like an uninterrupted run."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.models.gpt import preset
from paratrain.optim import lr_at
from paratrain.train import checkpoint, rundir, runs
from paratrain.train.config import ConfigError, load
from paratrain.train.metrics import MetricsWriter, keep_records_until
from paratrain.train.rundir import RunDirError, RunDirLock

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = dict(preset="tiny", seq_len=32, steps=6, eval_every=0, progress=False)


def config(**overrides):
    return load(None, {**TINY, **overrides}).validate()


def fake_checkpoint(run_dir: Path, step: int, cfg, run_id: str = "r1", **run: object) -> Path:
    """A complete checkpoint of the tiny model (zeros), written as the loop writes one
    (``run``: more of what its index says of the run, e.g. its ``config``)."""
    tensors = {name: torch.zeros(shape) for name, shape in checkpoint.expected_shapes(cfg.model).items()}
    data = {"step": step, **cfg.data_order()}
    meta = {"format": checkpoint.FORMAT, "step": step, "model": cfg.model.__dict__, "layout": "dp1",
            "run": {"id": run_id, **run}, "data": data}
    path = run_dir / "checkpoints" / f"step-{step}"
    checkpoint.write(tensors, path, meta)
    return path


def test_each_run_gets_its_directory_and_latest_points_at_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, notes = runs.place(config(), torchrun=False, now=0)
    second, _ = runs.place(config(name="exp"), torchrun=False, now=0)
    third, _ = runs.place(config(), torchrun=False, now=0)
    assert (first.train.run_dir, second.train.run_dir, third.train.run_dir) == (
        "runs/19700101-000000-tiny", "runs/19700101-000000-exp", "runs/19700101-000000-tiny-2")
    assert os.readlink("runs/latest") == "19700101-000000-tiny-2" and notes == []
    given, _ = runs.place(config(run_dir="elsewhere"), torchrun=False)
    assert given.train.run_dir == "elsewhere"  # exactly the given directory ...
    assert os.readlink("runs/latest") == "19700101-000000-tiny-2"  # ... and latest left alone
    assert runs.resume_mode("", torchrun=True) == "auto" and runs.resume_mode("", torchrun=False) == "none"


def test_auto_resumes_the_newest_complete_checkpoint_of_latest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config()
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    for step in (2, 4, 5):
        fake_checkpoint(run, step, cfg)
    state = run / "checkpoints" / "step-5" / checkpoint.STATE
    state.write_bytes(state.read_bytes()[:-8])  # a torn write: incomplete, skipped
    placed, notes = runs.place(config(resume="auto"), torchrun=False)
    assert placed.train.run_dir == str(run) and placed.train.resume == str(run / "checkpoints" / "step-4")
    assert notes[0].startswith("skipping step-5") and "resuming" in notes[1]
    under_torchrun, _ = runs.place(cfg, torchrun=True)  # auto is torchrun's default
    assert under_torchrun.train.resume == placed.train.resume


def test_a_checkpoint_moved_aside_by_an_interrupted_save_is_put_back(tmp_path, monkeypatch):
    """Re-saving step N moves the old step-N aside before the new one takes its place; a
    crash between the two renames leaves only .step-N.old, which --resume auto restores."""
    monkeypatch.chdir(tmp_path)
    cfg = config()
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    saved = fake_checkpoint(run, 4, cfg)
    saved.rename(saved.with_name(".step-4.old"))
    placed, notes = runs.place(config(resume="auto"), torchrun=False)
    assert notes[0] == "restored step-4: a save replacing it was interrupted"
    assert placed.train.resume == str(saved) and saved.is_dir()
    # a save that died before publishing leaves its temporary directory: --resume auto clears it
    torn = run / "checkpoints" / ".step-6.tmp"
    torn.mkdir()
    (torn / "rank-00000.safetensors").write_bytes(b"x" * 2**20)
    _, notes = runs.place(config(resume="auto"), torchrun=False)
    assert not torn.exists() and "removed .step-6.tmp (1.0 MiB)" in notes[0]
    # a crash after publishing leaves a stale .old beside the step: a re-save replaces both
    shutil.copytree(saved, saved.with_name(".step-4.old"))
    fake_checkpoint(run, 4, cfg)
    assert saved.is_dir() and not saved.with_name(".step-4.old").exists()


def test_a_checkpoint_named_through_latest_is_the_one_meant(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config()
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    wanted = fake_checkpoint(run, 2, cfg)
    placed, _ = runs.place(config(resume="runs/latest/checkpoints/step-2"), torchrun=False, now=60)
    assert placed.train.run_dir != str(run) and os.readlink("runs/latest") != run.name  # a new run ...
    assert Path(placed.train.resume).samefile(wanted)  # ... resuming the checkpoint latest named before


def test_resuming_with_other_data_settings_says_so(tmp_path, monkeypatch):
    """The data position is (seed, global batch, data settings, step): a resume that changes
    one reads other batches than the saved run would have, and the launcher says which."""
    monkeypatch.chdir(tmp_path)
    cfg = config()
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    saved = fake_checkpoint(run, 2, cfg)
    _, notes = runs.place(config(resume=str(saved)), torchrun=False, now=60)
    assert notes == []
    _, notes = runs.place(config(resume=str(saved), global_batch=32, seed=3), torchrun=False, now=120)
    assert notes == ["resuming with seed=3 (saved: 0), global_batch=32 (saved: 16): the batches "
                     "after step 2 are not the ones the saved run would have read next"]


def test_resuming_with_another_learning_rate_schedule_says_so(tmp_path, monkeypatch):
    """The cosine decay spans --steps: extending a run stretches the rest of it, and the
    launcher says so with the learning rate the next step gets either way."""
    monkeypatch.chdir(tmp_path)
    cfg = config(warmup_steps=1)
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    saved = fake_checkpoint(run, 3, cfg, config=dataclasses.asdict(cfg))
    _, notes = runs.place(config(resume=str(saved), warmup_steps=1), torchrun=False, now=60)
    assert notes == []
    _, notes = runs.place(config(resume=str(saved), warmup_steps=1, steps=11), torchrun=False, now=120)
    was, now = lr_at(3, 6, cfg.optim), lr_at(3, 11, cfg.optim)
    assert notes == [f"resuming with steps=11 (saved: 6): the learning rate from step 4 follows "
                     f"the new schedule ({now:.3g}, where the saved run's was {was:.3g})"]


def test_auto_starts_fresh_when_there_is_nothing_to_resume(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config(resume="auto")
    fresh, notes = runs.place(cfg, torchrun=False, now=0)  # no runs/latest yet
    assert fresh.train.resume == "" and notes == []
    empty, notes = runs.place(cfg, torchrun=False, now=60)  # latest has no checkpoint: a new run
    assert empty.train.run_dir != fresh.train.run_dir and "no complete checkpoint" in notes[0]
    fake_checkpoint(Path(empty.train.run_dir), 6, cfg)  # latest finished at steps=6: a new run
    after, notes = runs.place(cfg, torchrun=False, now=120)
    assert after.train.run_dir not in (empty.train.run_dir, fresh.train.run_dir)
    assert after.train.resume == "" and "finished at step 6" in notes[0]
    with pytest.raises(ConfigError, match="raise --steps"):  # a given directory is not replaced
        runs.place(config(resume="auto", run_dir=empty.train.run_dir), torchrun=False)
    given, notes = runs.place(config(resume="auto", run_dir="new"), torchrun=False)
    assert given.train.run_dir == "new" and given.train.resume == ""


def test_a_fresh_run_over_checkpoints_is_refused_and_names_auto(tmp_path):
    cfg = config(run_dir=str(tmp_path), save_every=2)
    fake_checkpoint(tmp_path, 2, cfg)
    with pytest.raises(RunDirError, match="--resume auto"):
        RunDirLock(cfg).acquire()


def test_the_run_directory_records_its_config_and_versions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = runs.place(config(lr=1e-3, dp=2, d_model=32, name="x", resume="auto"), torchrun=False)
    runs.record(cfg)
    run = Path(cfg.train.run_dir)
    again = load(str(run / "config.toml")).validate()  # `paratrain train --config` reads it back
    assert again.model == cfg.model and again.optim == cfg.optim and again.parallel == cfg.parallel
    assert again.data == cfg.data and again.tasks == cfg.tasks and again.model_preset == "tiny"
    assert again.train.__dict__ == {**cfg.train.__dict__, "run_dir": "", "resume": ""}
    assert set(json.loads((run / "versions.json").read_text())) == {"paratrain", "torch", "python"}
    wider = load(str(run / "config.toml"), {"nproc": 4}).validate()  # dp is derived, not pinned
    assert (wider.parallel.dp, wider.parallel.nproc) == (4, 4)


def test_a_resumed_run_keeps_the_records_up_to_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    writer = MetricsWriter(path, resume_step=3)  # killed at step 6 mid-line; resumed at 3
    writer.write({"step": 4, "loss": 0.5})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    csv = tmp_path / "metrics.csv"
    csv.write_text('step,loss,peak_mem\n1,1.0,"[1, 2]"\n2,1.0,\n3,1.0,\n4,1.')
    keep_records_until(csv, 2)
    assert csv.read_text() == 'step,loss,peak_mem\n1,1.0,"[1, 2]"\n2,1.0,\n'


# ---- a torchrun job, killed and restarted ---------------------------------------------------

STEPS, EVERY = 40, 4
TRAIN = ["train", "--model", "tiny", "--seq-len", "32", "--steps", str(STEPS), "--save-every", str(EVERY),
         "--eval-every", "0", "--no-progress", "--warmup-steps", "2", "--grad-clip", "0"]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (parameters, moments), whole, by kind/name."""
    _, state = checkpoint.load(directory, preset("tiny"))
    return {f"{kind}/{name}": t for kind, tensors in state.items() for name, t in tensors.items()}


def wait_for(path: Path, job: subprocess.Popen, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None, f"the job ended before {path} appeared:\n{job.communicate()[0]}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


@pytest.mark.timeout(900)  # ~50 s on a quiet machine; minutes when it is loaded
def test_a_killed_torchrun_job_restarts_resumes_and_ends_like_an_uninterrupted_run(tmp_path, background):
    from test_launch import free_port

    env = {**os.environ, "PYTHONPATH": SRC}
    job = background(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}",
         "-m", "paratrain", *TRAIN],  # no --run-dir, no --resume: auto, by runs/latest
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(tmp_path / "runs" / "latest" / "checkpoints" / f"step-{EVERY}" / "meta.json", job)
    owner = json.loads((tmp_path / "runs" / "latest" / ".lock").read_text())["pid"]  # global rank 0
    os.kill(owner, signal.SIGKILL)
    output = job.communicate(timeout=400)[0]
    assert job.returncode == 0, output
    assert "resuming" in output and output.count("run directory") == 2, output
    resumed_at = int(output.split("resuming ")[1].split("(step ")[1].split(")")[0])
    assert EVERY <= resumed_at < STEPS, output  # killed mid-run, resumed from a checkpoint
    run = (tmp_path / "runs" / "latest").resolve()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # every step once

    reference = subprocess.run([sys.executable, "-m", "paratrain", *TRAIN, "--nproc", "2",
                                "--run-dir", str(tmp_path / "ref")], env=env, capture_output=True,
                               text=True, timeout=240)
    assert reference.returncode == 0, reference.stderr
    got = _tensors(run / "checkpoints" / f"step-{STEPS}")
    want = _tensors(tmp_path / "ref" / "checkpoints" / f"step-{STEPS}")
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"final state differs from the uninterrupted run's by {worst}"


def test_each_torchrun_attempt_sees_its_own_keys_in_the_shared_store():
    """The end-to-end restart test above catches a shared prefix only when a restarted rank
    happens to read before its peer republishes; this catches it every time."""
    from test_launch import free_port

    from paratrain.launch import WorldSpec, _attempt_store

    port = free_port()
    server = torch.distributed.TCPStore("localhost", port, 1, is_master=True, wait_for_workers=False)
    killed, restarted = (WorldSpec(rank=1, world_size=2, local_rank=1, backend="gloo",
                                   init_method="env://", store_at=("localhost", port, True),
                                   attempt=a, timeout_s=5.0) for a in (0, 1))
    timeout = datetime.timedelta(seconds=5)
    _attempt_store(killed, timeout).set("rank_0", "a dead peer's address")
    again = _attempt_store(restarted, timeout)
    assert not again.check(["rank_0"]), "a restarted attempt can read the killed attempt's keys"
    again.set("rank_0", "a live address")
    assert _attempt_store(killed, timeout).get("rank_0") == b"a dead peer's address"
    del server


def test_a_fresh_run_never_overwrites_another_runs_records(tmp_path, monkeypatch):
    """A fresh run (no --resume) in a directory holding another run's metrics or
    checkpoints is refused before launch, as is an existing --metrics file; --resume auto
    over another model's checkpoints is refused rather than started fresh over them."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "r1"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds another run's metrics.jsonl.*--resume auto"):
        runs.place(config(run_dir=str(run)), torchrun=False)
    with pytest.raises(ConfigError, match="--metrics .* exists"):
        runs.place(config(metrics=str(run / "metrics.jsonl")), torchrun=False)
    # a live run there: the lock names it, not the overwrite check (which would say "resume")
    (run / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    placed, _ = runs.place(config(run_dir=str(run)), torchrun=False)
    with pytest.raises(RunDirError, match="in use by another paratrain run"):
        RunDirLock(placed).acquire()
    (run / ".lock").unlink()
    (run / "metrics.jsonl").unlink()
    fake_checkpoint(run, 2, config())
    with pytest.raises(ConfigError, match="holds another run's step-2"):
        runs.place(config(run_dir=str(run)), torchrun=False)
    with pytest.raises(ConfigError, match="holds a run of another model"):
        runs.place(config(run_dir=str(run), resume="auto", d_model=32), torchrun=False)
    placed, _ = runs.place(config(run_dir=str(run), resume="auto"), torchrun=False)  # its own model
    assert placed.train.resume.endswith("step-2")


def test_auto_resume_past_a_damaged_checkpoint_takes_the_run_directory(tmp_path, monkeypatch):
    """--resume auto skips a checkpoint whose index is gone; the run it resumes may then
    write beside it (and replaces it when it saves that step)."""
    monkeypatch.chdir(tmp_path)
    cfg = config(save_every=2)
    run = Path(runs.place(cfg, torchrun=False, now=0)[0].train.run_dir)
    for step in (2, 4):
        fake_checkpoint(run, step, cfg)
    (run / "checkpoints" / "step-4" / checkpoint.INDEX).unlink()
    placed, notes = runs.place(config(resume="auto", save_every=2), torchrun=False)
    assert placed.train.resume == str(run / "checkpoints" / "step-2") and notes[0].startswith("skipping step-4")
    RunDirLock(placed).acquire().release()
    with pytest.raises(RunDirError, match="another run"):  # a fresh run there still may not
        RunDirLock(config(run_dir=str(run), save_every=2)).acquire()


def test_resuming_an_older_checkpoint_beside_newer_ones_of_its_run_is_refused(tmp_path):
    """Going back to step 2 in the directory that holds steps 4 and 6 of the same run would
    leave them for a later --resume auto to mix in; the newest may be resumed there."""
    cfg = config(save_every=2)
    saved = {step: fake_checkpoint(tmp_path, step, cfg) for step in (2, 4, 6)}
    with pytest.raises(RunDirError, match=r"step-4, step-6 of the run .* newer than it"):
        RunDirLock(config(run_dir=str(tmp_path), save_every=2, resume=str(saved[2]))).acquire()
    RunDirLock(config(run_dir=str(tmp_path), save_every=2, steps=8, resume=str(saved[6]))).acquire().release()


def test_a_resume_never_cuts_another_runs_records(tmp_path):
    """A resumed run cuts its directory's metrics back to the step it resumes: it is refused
    where those records are another run's (``run.json`` names their run; records from before
    it count as the run's whose checkpoint lies in the directory)."""
    cfg = config(save_every=2)
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    ckpt = fake_checkpoint(mine, 2, cfg, run_id="r1")
    (theirs / "metrics.jsonl").parent.mkdir()
    (theirs / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    resume_there = config(run_dir=str(theirs), resume=str(ckpt))
    with pytest.raises(ConfigError, match=r"holds another run's metrics.jsonl, which resuming .* "
                                          r"would cut back to step 2"):
        runs.place(resume_there, torchrun=False)
    rundir.claim_records(theirs, "r0")
    with pytest.raises(ConfigError, match="holds run r0's metrics.jsonl"):
        runs.place(resume_there, torchrun=False)
    assert len((theirs / "metrics.jsonl").read_text().splitlines()) == 3  # untouched
    rundir.claim_records(theirs, "r1")  # the records are the resumed run's own
    assert runs.place(resume_there, torchrun=False)[0].train.resume == str(ckpt)
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')  # no run.json: the checkpoint's directory
    assert runs.place(config(run_dir=str(mine), resume=str(ckpt)), torchrun=False)[0].train.resume


def test_auto_resume_never_starts_fresh_over_a_run_that_finished_without_checkpoints(tmp_path):
    """--resume auto (the torchrun default) with no checkpoint starts fresh in the directory:
    right after a kill before the first save, not over a finished run's records."""
    run = tmp_path / "run"
    placed, _ = runs.place(config(run_dir=str(run), steps=3), torchrun=False)
    runs.record(placed)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    again = config(run_dir=str(run), steps=2, resume="auto")
    assert runs.place(again, torchrun=False)[0].train.resume == ""  # killed at step 2 of 3: fresh
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"st')
    with pytest.raises(ConfigError, match=r"finished \(its metrics.jsonl reaches step 3 of steps=3\)"):
        runs.place(again, torchrun=True)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_metrics_path_that_cannot_be_a_file_is_refused_before_launch(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"'.*a-file' is a file, so no directory can be made"):
        runs.place(config(metrics=str(tmp_path / "a-file" / "m.jsonl")), torchrun=False)
    with pytest.raises(ConfigError, match="is a directory; give a file path"):
        runs.place(config(metrics=str(tmp_path)), torchrun=False)


def test_summary_reports_data_parallel_traffic_and_its_compression():
    """The closing report's traffic line averages the steps' bytes and names no payload
    (gradients, or AdamW's updates under --compress METHOD:update)."""
    from paratrain.train.metrics import summary

    step = {"loss": 2.0, "tokens": 1024, "step_time_s": 0.5}
    records = [{**step, "comm_bytes": 1000, "comm_ratio": 20.0},
               {**step, "comm_bytes": 3000, "comm_ratio": 20.0}]
    ranks = [{"param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1}]
    line = next(x for x in summary(records, ranks, 1.0).splitlines() if "sent per step" in x)
    assert line.startswith("dp traffic") and "compression ratio 20.0x" in line
    assert "2.0 KiB sent" in line, line  # the mean of 1000 and 3000 bytes
    assert "sent per step" not in summary([step], ranks, 1.0)  # no reduction: no line
