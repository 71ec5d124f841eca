"""Checkpoints are layout-independent: save under one layout, resume under another, and the
run continues exactly as if it had never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from distributed import run_world
from paratrain.train import checkpoint
from paratrain.train.config import ConfigError, load
from paratrain.train.rundir import records_owner
from helpers import assert_identical_runs, assert_same_run, tail, tiny_config, train_runs

STEPS = 6


def resume_config(tmp: str, nproc: int, resume: str = "", **overrides):
    return tiny_config(tmp, nproc=nproc, lr=1e-3, steps=STEPS, resume=resume, **overrides)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dp2 x ZeRO-1 run that saves every 3 steps, and the uninterrupted reference."""
    tmp = tmp_path_factory.mktemp("ckpt")
    run_world(train_runs, 2, {"a": resume_config(str(tmp / "a"), 2, zero=1, save_every=3)})
    reference = run_world(train_runs, 1, {"ref": resume_config(str(tmp / "ref"), 1)})[0]["ref"]
    return tmp / "a" / "checkpoints" / "step-3", reference


@pytest.mark.timeout(900)  # five worlds (two to save, three to resume): minutes on a loaded machine
def test_resume_under_other_layouts_continues_the_run(saved, tmp_path):
    ckpt, reference = saved
    assert checkpoint.read_meta(ckpt)["step"] == 3
    want = tail(reference, since=3)
    layouts = [dict(nproc=1), dict(nproc=2, zero=3), dict(nproc=4, dp=1, tp=2, pp=2, microbatches=2)]
    for layout in layouts:
        nproc = layout.pop("nproc")
        got = run_world(train_runs, nproc, {"b": resume_config(str(tmp_path), nproc, str(ckpt), **layout)})
        assert len(got[0]["b"]["losses"]) == STEPS - 3
        assert_same_run(tail(got[0]["b"]), want, what=str(layout))


def test_bad_checkpoints_are_reported_before_launch(saved, tmp_path):
    ckpt, _ = saved
    # rank 0 named the run whose records the directory holds: a resume elsewhere may not cut them
    assert records_owner(ckpt.parent.parent) == checkpoint.read_meta(ckpt)["run"]["id"]
    with pytest.raises(ConfigError, match="no checkpoint"):
        resume_config(str(tmp_path), 1, str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="another model"):
        resume_config(str(tmp_path), 1, str(ckpt), d_model=32)
    with pytest.raises(ConfigError, match="holds a language model, and this run trains a heat2d "
                                          "U-Net; resume it with --task lm"):
        load(None, dict(task="heat2d", resume=str(ckpt), steps=STEPS, run_dir=str(tmp_path))).validate()
    with pytest.raises(ConfigError, match="raise --steps"):
        tiny_config(str(tmp_path), nproc=1, steps=3, resume=str(ckpt))
    broken = tmp_path / "broken"  # the index, and one rank's file cut short
    shutil.copytree(ckpt, broken)
    first = sorted(checkpoint.read_meta(ckpt)["files"])[0]
    (broken / first).write_bytes((Path(ckpt) / first).read_bytes()[:100])
    from paratrain.models.gpt import PRESETS

    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.load(broken, PRESETS["tiny"])


def test_bf16_zero_resumes_from_its_fp32_master_weights(tmp_path):
    """ZeRO with bf16 weights steps fp32 masters; the checkpoint keeps the masters, so the
    resumed run is the uninterrupted one bit for bit (a bf16 copy would round them)."""
    bf16 = dict(zero=2, precision="bf16", tie_embeddings=False)
    run = run_world(train_runs, 2, {"a": resume_config(str(tmp_path / "a"), 2, save_every=3, **bf16)})[0]["a"]
    ckpt = tmp_path / "a" / "checkpoints" / "step-3"
    assert checkpoint.read_meta(ckpt)["tensors"]["param/layers.0.attn.wq.weight"]["dtype"] == "float32"
    got = run_world(train_runs, 2, {"b": resume_config(str(tmp_path / "b"), 2, str(ckpt), **bf16)})[0]["b"]
    assert_identical_runs(tail(got), tail(run, since=3), what="bf16 ZeRO-2 resumed")


def test_a_run_directory_given_to_resume_names_resume_auto(tmp_path):
    """`--resume RUN_DIR` was told to give "the directory --save-every wrote", though the
    user had: the run's, whose newest checkpoint --resume auto --run-dir takes. No processes."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointError,
                       match=rf"it is a run directory; .*--resume auto --run-dir {run}, or give "
                             rf"one of {run}/checkpoints/step-N"):
        checkpoint.read_meta(run)
    with pytest.raises(checkpoint.CheckpointError, match=r"give the directory .* wrote"):
        checkpoint.read_meta(tmp_path / "elsewhere")


@pytest.mark.timeout(600)
def test_a_vocabulary_padded_by_tensor_parallelism_resumes_under_another_layout(tmp_path):
    """A blind spot: tp2 pads a 259-token vocabulary to 260 rows, the last rank holding the
    padding row. Its checkpoint stores the 259 real rows only, and a resume on one process
    continues the run exactly."""
    vocab = dict(vocab_size=259)
    run_world(train_runs, 2, {"tp2": resume_config(str(tmp_path / "tp2"), 2, tp=2, dp=1, save_every=3, **vocab)})
    ckpt = tmp_path / "tp2" / "checkpoints" / "step-3"
    meta = checkpoint.read_meta(ckpt)
    assert meta["tensors"]["param/tok_embeddings.weight"]["shape"][0] == 259
    runs = run_world(train_runs, 1, {"ref": resume_config(str(tmp_path / "ref"), 1, **vocab),
                                     "b": resume_config(str(tmp_path / "b"), 1, str(ckpt), **vocab)})[0]
    assert_same_run(tail(runs["b"]), tail(runs["ref"], since=3), what="tp2 -> one process, vocabulary 259")
