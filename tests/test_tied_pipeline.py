"""A tied embedding under a pipeline (parallel/pipeline/tied.py): the last stage projects
with a copy of the embedding whose gradient is added to the first stage's before the
data-parallel reduction, so the two stay one tensor. Parity with one process (losses,
gradient norms, first-step gradients, final parameters; clipping off, and active) at pp2,
interleaved pp2 x v2, tp2 x pp2 and dp2 x pp2 x ZeRO-1; a checkpoint of a pp2 run holds the
tensor once and resumes on one process."""

from __future__ import annotations

import pytest

from distributed import run_world
from helpers import assert_same_run, tail, tiny_config, train_runs
from paratrain.train import checkpoint

TIED = dict(tie_embeddings=True, n_layers=4, steps=4)


def _configs(tmp: str, nproc: int, layouts: dict) -> dict:
    out = {}
    for name, layout in layouts.items():
        out[name] = tiny_config(f"{tmp}/{name}", nproc=nproc, **TIED, **layout)
        out[f"{name} clipped"] = tiny_config(f"{tmp}/{name}-c", nproc=nproc, grad_clip=0.05,
                                             **TIED, **layout)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ref"))
    return run_world(train_runs, 1, _configs(tmp, 1, {"one": {}}))[0]


def _check(runs: list[dict], reference: dict, layouts: dict) -> None:
    for name in layouts:
        for suffix in ("", " clipped"):
            want = reference[f"one{suffix}"]
            for rank, got in enumerate(runs):
                assert "output.weight" not in got[f"{name}{suffix}"]["params"]  # the tensor once
                assert_same_run(got[f"{name}{suffix}"], want, what=f"{name}{suffix} rank {rank}")


def test_pp2_and_interleaved_equal_one_process(reference, tmp_path):
    layouts = {"pp2": dict(pp=2, dp=1, microbatches=2),
               "pp2 v2": dict(pp=2, dp=1, schedule="interleaved", virtual_stages=2, microbatches=2)}
    _check(run_world(train_runs, 2, _configs(str(tmp_path), 2, layouts)), reference, layouts)


def _nccl_path_runs(configs: dict) -> dict:
    """``train_runs`` with the collectives NCCL's path takes (a reduce-scatter into each
    rank's shard, not gloo's whole-buffer all-reduce: comm/backend.ring_path), so that the
    tied gradients must be summed before ZeRO-1 reduces them, as on GPUs."""
    from paratrain.comm import backend

    original = backend.ring_path
    backend.ring_path = lambda group, ring=None: bool(ring)
    try:
        return train_runs(configs)
    finally:
        backend.ring_path = original


def test_dp2_pp2_zero1_and_tp2_pp2_equal_one_process(reference, tmp_path):
    layouts = {"dp2 pp2 zero1": dict(dp=2, pp=2, zero=1, microbatches=2),
               "tp2 pp2": dict(tp=2, pp=2, dp=1, microbatches=2)}
    _check(run_world(_nccl_path_runs, 4, _configs(str(tmp_path), 4, layouts)), reference, layouts)


def test_a_pp2_checkpoint_holds_the_tensor_once_and_resumes_on_one_process(reference, tmp_path):
    run_world(train_runs, 2, {"a": tiny_config(str(tmp_path / "a"), nproc=2, pp=2, dp=1,
                                               microbatches=2, save_every=2, **TIED)})
    ckpt = tmp_path / "a" / "checkpoints" / "step-2"
    names = checkpoint.read_meta(str(ckpt))["tensors"]
    assert "param/tok_embeddings.weight" in names and "param/output.weight" not in names
    got = run_world(train_runs, 1, {"b": tiny_config(str(tmp_path / "b"), nproc=1, resume=str(ckpt),
                                                     **TIED)})[0]["b"]
    assert_same_run(tail(got), tail(reference["one"], since=2), what="resumed on one process")
