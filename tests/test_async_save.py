"""Checkpoints written in the background (``--async-save``): the same files as the
synchronous path, nothing published when a rank dies mid-write, one save in flight."""

from __future__ import annotations

import json
import os
import time

import pytest

from distributed import run_world
from helpers import assert_same_run, tail, tiny_config, train_runs


def _config(tmp, **kw):
    return tiny_config(str(tmp), **{**dict(nproc=2, zero=1, steps=4, save_every=2, eval_every=0), **kw})


def _slow_writes(seconds: float) -> None:
    """Make every rank's file write take ``seconds`` longer: the steps after a save then
    run while it is written."""
    from paratrain.train import checkpoint

    original = checkpoint._write_file

    def slow_write(*args):
        time.sleep(seconds)
        return original(*args)

    checkpoint._write_file = slow_write


def slowly_written_runs(configs: dict) -> dict:
    _slow_writes(0.5)
    return train_runs(configs)


def test_background_saves_write_the_synchronous_files_and_resume_exactly(tmp_path):
    run_world(slowly_written_runs, 2, {"sync": _config(tmp_path / "sync"),
                                       "async": _config(tmp_path / "async", async_save=True)})
    for step in (2, 4):
        metas = [json.loads((tmp_path / kind / "checkpoints" / f"step-{step}" / "meta.json").read_text())
                 for kind in ("sync", "async")]
        assert metas[0]["files"] == metas[1]["files"] and len(metas[0]["files"]) == 2  # bytes, sha256
        assert metas[0]["tensors"] == metas[1]["tensors"]
    assert not list((tmp_path / "async" / "checkpoints").glob(".*"))  # no temporary left
    ckpt = str(tmp_path / "async" / "checkpoints" / "step-2")
    runs = run_world(train_runs, 2, {"ref": _config(tmp_path / "ref"),
                                     "resumed": _config(tmp_path / "resumed", resume=ckpt, async_save=True)})
    for rank, got in enumerate(runs):
        assert_same_run(tail(got["resumed"]), tail(got["ref"], since=2), what=f"rank {rank}")


def die_while_writing(cfg) -> None:
    """Rank 1 dies two seconds into writing step-2's file; rank 0 has written its own."""
    import torch.distributed as dist
    from paratrain.train import checkpoint

    original = checkpoint._write_file

    def write(tmp, name, pieces, directory):
        if dist.get_rank() == 1 and directory.name == "step-2":
            time.sleep(2)
            os._exit(1)
        return original(tmp, name, pieces, directory)

    checkpoint._write_file = write
    train_runs({"run": cfg})


def test_a_rank_dying_during_the_background_write_publishes_nothing(tmp_path):
    from paratrain.launch import RankFailed
    from paratrain.train.saved import published

    with pytest.raises(RankFailed):
        run_world(die_while_writing, 2, _config(tmp_path, async_save=True), timeout_s=120)
    assert not (tmp_path / "checkpoints" / "step-2").exists()
    assert published(tmp_path) == []


def saves_in_flight(cfg) -> dict:
    """Train with a wrapped saver: the staged bytes of each save and whether the previous
    one was still being written when the next was staged."""
    from paratrain.train import async_save
    from paratrain.train.metrics import state_bytes

    seen = {"staged": [], "overlapping": 0}
    original = async_save.AsyncSaver.submit

    def submit(self, directory, engine, meta, agree):
        published = original(self, directory, engine, meta, agree)
        seen["staged"].append(self.staged_bytes)
        seen["state"] = state_bytes(engine.state_tensors())
        return published

    original_stage = async_save.AsyncSaver._stage

    def stage(self, piece, index):
        seen["overlapping"] += self._thread is not None and self._thread.is_alive()
        return original_stage(self, piece, index)

    async_save.AsyncSaver.submit, async_save.AsyncSaver._stage = submit, stage
    _slow_writes(0.5)  # still writing when the next save is due, two steps later
    train_runs({"run": cfg})
    return seen


def test_one_save_in_flight_holds_at_most_the_ranks_own_state(tmp_path):
    for rank, seen in enumerate(run_world(saves_in_flight, 2, _config(tmp_path, async_save=True,
                                                                        steps=6))):
        state = seen["state"]
        assert seen["overlapping"] == 0 and len(seen["staged"]) == 3
        assert 0 < max(seen["staged"]) <= state["param_bytes"] + state["optim_bytes"], (rank, seen)


def fail_in_the_background(cfg) -> str:
    """Rank 1's write of step-2 fails; every rank learns it when step 4's save waits."""
    import torch.distributed as dist
    from paratrain.train import checkpoint
    from paratrain.train.shardio import CheckpointError

    original = checkpoint._write_file

    def write(tmp, name, pieces, directory):
        if dist.get_rank() == 1 and directory.name == "step-2":
            raise CheckpointError("disk full (simulated)")
        return original(tmp, name, pieces, directory)

    checkpoint._write_file = write
    try:
        train_runs({"run": cfg})
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_failed_background_write_raises_on_every_rank(tmp_path):
    got = run_world(fail_in_the_background, 2, _config(tmp_path, async_save=True))
    assert got == ["disk full (simulated) (on rank 1)"] * 2
    assert not (tmp_path / "checkpoints" / "step-2").exists()
