"""Faults in a run's state end in a named failure, never in bad data or lost work:
non-finite losses and gradients, failed checkpoint and metric writes, corrupt or partial
checkpoints, and run directories that are read-only or belong to another run. Process
faults (hangs, killed ranks, Ctrl-C) are in test_faults.py.
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
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
from helpers import TINY, strict_json, tiny_config


def test_a_fresh_run_never_overwrites_another_runs_checkpoints(tmp_path):
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    assert main(["train", *TINY, "--steps", "3", "--save-every", "3", "--run-dir", str(tmp_path)]) == 2
    # and under the lock, where a torchrun job's `--resume auto` arrives once rank 0 placed it
    with pytest.raises(RunDirError, match="holds checkpoints of another run"):
        RunDirLock(tiny_config(str(tmp_path), nproc=2, steps=3, save_every=3)).acquire()
    assert not (tmp_path / ".lock").exists()  # refused: no lock left behind


def test_a_checkpoints_path_that_is_a_file_is_refused_before_launch(tmp_path, capsys):
    """RUN_DIR/checkpoints as a file: the run trained up to its first save, then failed
    with 'Not a directory ... Free space or choose a writable --run-dir'."""
    (tmp_path / "checkpoints").write_text("not a directory")
    assert main(["train", *TINY, "--steps", "3", "--save-every", "2", "--run-dir", str(tmp_path)]) == 2
    assert "checkpoints' is a file, not a directory" in capsys.readouterr().err
    assert not (tmp_path / ".lock").exists() and not (tmp_path / "metrics.jsonl").exists()


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


COMPRESSED = ("int8", "powersgd:2", "topk:0.5", "topk:0.5:update")
"""Skipping a non-finite step must leave no NaN in their state (residual, Q, Adam moments)."""


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
    for method in COMPRESSED:
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
    for kind in ("full", "read-only", "rank 1 only", "pieces"):
        sharded = dict(zero=1, tie_embeddings=False) if kind in ("rank 1 only", "pieces") else {}  # rank 1 writes
        cfg = tiny_config(f"{tmp}/{kind}", nproc=2, steps=2, eval_every=0, save_every=2, **sharded)
        owner, name = {"read-only": (Path, "mkdir"), "pieces": (checkpoint.S, "engine_pieces")}.get(
            kind, (checkpoint, "save_file"))
        real = getattr(owner, name)
        setattr(owner, name, failing_write(kind) if kind != "pieces" else failing_pieces(real))
        try:
            loop.train(cfg, Mesh.build(cfg.layout))
        except Exception as exc:  # noqa: BLE001
            out[kind] = f"{type(exc).__name__}: {exc}"
        finally:
            setattr(owner, name, real)
    return out


def failing_pieces(real):
    """Collecting the slices to save fails on rank 1 only (before any file is opened)."""
    def engine_pieces(engine, for_save):
        if for_save and dist.get_rank() == 1:
            raise RuntimeError("a slice outside its tensor")
        return real(engine, for_save)
    return engine_pieces


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
        for method in COMPRESSED:
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
        assert "RuntimeError: a slice outside its tensor (on rank 1)" in out["pieces"], out["pieces"]
    records = strict_json(tmp_path / "skip" / "metrics.jsonl")
    assert records[1]["loss"] is None and records[1]["skipped"] == 1 and records[1]["nonfinite_ranks"] == [1]
    meta, tensors = checkpoint.verify(tmp_path / "skip" / "checkpoints" / "step-5", PRESETS["tiny"])
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert meta["run"]["seed"] == 0 and meta["run"]["config"]["train"]["on_nonfinite"] == "skip"
    assert meta["data"]["step"] == 5 and meta["data"]["samples_seen"] == 5 * 8
    assert meta["nonfinite"]["skipped"] == 1
    # averaging AdamW's updates, the skipped step reduced nothing: 3 reductions of 4 steps
    meta, tensors = checkpoint.verify(tmp_path / "skip-topk_0.5_update" / "checkpoints" / "step-4", PRESETS["tiny"])
    counts = [int(tensors[k]) for k in meta["tensors"] if k.endswith(".reductions")]
    assert counts and set(counts) == {3}, counts
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
