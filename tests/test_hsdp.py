"""HSDP (ZeRO-3 hybrid sharding): states sharded within groups of dp x cp ranks and
replicated across them, against one process, under tp, pp, cp and expert parallelism; its
checkpoints against ZeRO-3 and one process; its groups and its refusals."""

from __future__ import annotations

import pytest

from distributed import run_world
from helpers import assert_same_run, tail, tiny_config, train_runs
from paratrain.layout import Layout, LayoutError
from paratrain.train.config import ConfigError

CLIP = 0.5
"""Active clipping: the reference's norms are above it at every step."""

MOE = dict(n_experts=4, top_k=2, expert_ffn=64, moe_first_dense=1)

LAYOUTS = {
    "dp4 hsdp2": (4, dict(dp=4)),
    "dp4 hsdp2 ep2 (MoE)": (4, dict(dp=4, ep=2, **MOE)),
    "dp2 cp2 hsdp2": (4, dict(dp=2, cp=2)),
    "dp4 hsdp2 tp2 SP": (8, dict(dp=4, tp=2, sp=True)),
    "dp4 hsdp2 pp2": (8, dict(dp=4, pp=2, micro_batch=1)),
}
SLOW = {"dp4 hsdp2 tp2 SP", "dp4 hsdp2 pp2"}
"""Eight ranks on two cores: ``pytest -m slow tests/test_hsdp.py``."""
"""(processes, fields) of each HSDP layout, all with zero=3 and shard_group=2."""


def _configs(tmp: str, nproc: int, **fields) -> dict:
    hsdp = dict(zero=3, shard_group=2) if nproc > 1 else {}
    base = dict(n_layers=4, eps=1e-6, **hsdp, **fields)  # eps: as in test_hybrid
    return {"plain": tiny_config(tmp, nproc=nproc, **base),
            "clipped": tiny_config(tmp, nproc=nproc, grad_clip=CLIP, **base)}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs of the dense and the MoE model."""
    tmp = str(tmp_path_factory.mktemp("ref"))
    runs = run_world(train_runs, 1, {**_configs(tmp, 1), **{f"moe {k}": v for k, v in
                                                              _configs(tmp, 1, **MOE).items()}})[0]
    assert min(runs["clipped"]["grad_norms"]) > CLIP and min(runs["moe clipped"]["grad_norms"]) > CLIP
    return runs


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_hsdp_matches_one_process(name, references, tmp_path):
    nproc, fields = LAYOUTS[name]
    runs = run_world(train_runs, nproc, _configs(str(tmp_path), nproc, **fields))
    prefix = "moe " if "n_experts" in fields else ""
    for config in ("plain", "clipped"):
        for rank, got in enumerate(runs):
            assert_same_run(got[config], references[prefix + config], what=f"{config} {name} rank {rank}")


def test_checkpoints_move_between_hsdp_zero3_and_one_process(tmp_path):
    """Saved at dp4 hsdp2 (only the first replica of each shard writes), resumed on one
    process and at dp2 ZeRO-3; and a dp2 ZeRO-3 checkpoint resumed at dp4 hsdp2."""
    def config(tmp, nproc, resume="", **kw):
        return tiny_config(str(tmp), nproc=nproc, steps=4, eval_every=0, resume=resume, eps=1e-6, **kw)
    hsdp, zero3 = dict(zero=3, shard_group=2), dict(zero=3)
    saved = {k: str(tmp_path / k / "checkpoints" / "step-2") for k in "ab"}
    run_world(train_runs, 4, {"a": config(tmp_path / "a", 4, save_every=2, **hsdp)})
    # Four worlds, not five (worlds are slow to start): the dp2 save runs in the world of the
    # dp2 resume from hsdp, which the save does not touch (each run has its own directory).
    dp2 = run_world(train_runs, 2, {"b": config(tmp_path / "b", 2, save_every=2, **zero3),
                                    "z": config(tmp_path / "d", 2, resume=saved["a"], **zero3)})
    one = run_world(train_runs, 1, {"ref": config(tmp_path / "ref", 1),
                                    "from hsdp": config(tmp_path / "c", 1, resume=saved["a"])})[0]
    want = tail(one["ref"], since=2)
    assert_same_run(tail(one["from hsdp"]), want, what="hsdp -> one process")
    for rank, got in enumerate(dp2):
        assert_same_run(tail(got["z"]), want, what=f"hsdp -> zero3 rank {rank}")
    for rank, got in enumerate(run_world(train_runs, 4, {"h": config(tmp_path / "e", 4, resume=saved["b"],
                                                                          **hsdp)})):
        assert_same_run(tail(got["h"]), want, what=f"zero3 -> hsdp rank {rank}")


def test_shard_and_replica_groups_fold_onto_dp_x_cp():
    layout = Layout(dp=4, cp=2, tp=2, shard_group=4)
    assert layout.hsdp and "hsdp4" in layout.describe()
    for rank in range(layout.world_size):
        shard, replicas = layout.shard_ranks(rank), layout.replica_ranks(rank)
        group = layout.ranks_along(("dp", "cp"), rank)
        assert len(shard) == 4 and len(replicas) == 2 and set(shard) <= set(group)
        assert set(shard) & set(replicas) == {rank}
        assert shard == group[group.index(rank) // 4 * 4:][:4]  # consecutive ranks: one node
    assert not Layout(dp=4, shard_group=4).hsdp  # one group of all: plain ZeRO-3
    with pytest.raises(LayoutError, match=r"must divide 4 \(one of \[2\]\)"):
        Layout(dp=4, shard_group=3)


def test_a_shard_group_without_zero3_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="--shard-group 2 is ZeRO-3's hybrid sharding"):
        tiny_config(str(tmp_path), nproc=4, zero=2, shard_group=2)
