"""Sharded checkpoints (format 3): saved at dp2 x ZeRO-3, resumed at tp2 x pp2 and on one
process as if the run had never stopped; incomplete checkpoints refused before launch; the
extra memory of a save or a load bounded by the largest tensor, measured from live storages."""

from __future__ import annotations

import json
import math
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distributed import run_world
from paratrain.accounting import storage_bytes
from paratrain.cli import main
from paratrain.mesh import Mesh
from paratrain.train import checkpoint, loop, publish
from helpers import assert_same_run, tail, tiny_config, train_runs

STEPS = 6
TINY = ["--model", "tiny", "--seq-len", "32", "--eval-every", "0", "--no-progress", "--nproc", "1"]


def resume_config(tmp: str, nproc: int, resume: str = "", **overrides):
    return tiny_config(tmp, nproc=nproc, lr=1e-3, steps=STEPS, resume=resume, **overrides)


class LiveStorages(TorchDispatchMode):
    """Peak bytes of the storages that appear during a block (beyond ``baseline``'s), seen
    as inputs or outputs of every torch operation and counted while a tensor on them lives."""

    def __init__(self, baseline: list[torch.Tensor]):
        super().__init__()
        self.baseline = {t.untyped_storage().data_ptr() for t in baseline if t is not None}
        self.live: dict[int, tuple[list, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: (refs, n) for k, (refs, n) in self.live.items() if any(r() is not None for r in refs)}
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.baseline:
                    refs, _ = self.live.setdefault(ptr, ([], storage.nbytes()))
                    refs.append(weakref.ref(t))
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def measure(cfg, directory: str) -> dict:
    """Save and load one engine's checkpoint under ``cfg``'s layout, measuring the bytes
    each allocates; check the round trip restores every local tensor bit for bit."""
    mesh = Mesh.build(cfg.layout)
    run = loop.build(cfg, mesh)
    loop.train_step(run, 0)
    engine = run.engine
    state = engine.state_tensors()
    resident = [*state["params"], *state["grads"], *state["optim"], *engine.module.buffers()]
    kept = [t for t in [*state["params"], *state["optim"]] if t.untyped_storage().nbytes()]
    before = [t.detach().clone() for t in kept]  # (ZeRO-3's gathered buffers are freed)
    with LiveStorages(resident) as saving:
        checkpoint.save(Path(directory), 1, engine, cfg.model, cfg.layout.describe())
    with torch.no_grad():
        for t in kept:
            t.add_(1.0)  # loading must overwrite every element
    with LiveStorages(resident) as loading:
        checkpoint.load_into(engine, directory, cfg.model)
    restored = all(torch.equal(a, b) for a, b in zip(before, kept))
    return {"save_extra": saving.peak, "load_extra": loading.peak, "restored": restored,
            "share": storage_bytes([*state["params"], *state["optim"]]),
            "model": 12 * cfg.model.num_params(),
            "largest": 4 * max(math.prod(s) for s in checkpoint.expected_shapes(cfg.model).values())}


def resume_and_measure(configs: dict, memory: dict) -> dict:
    out = train_runs(configs)
    out["memory"] = {name: measure(cfg, directory) for name, (cfg, directory) in memory.items()}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dp2 x ZeRO-3 run that saves at step 3 (and 6)."""
    tmp = tmp_path_factory.mktemp("sharded")
    run_world(train_runs, 2, {"a": resume_config(str(tmp / "a"), 2, zero=3, save_every=3)})
    return tmp / "a" / "checkpoints" / "step-3"


@pytest.mark.timeout(600)
def test_zero3_checkpoint_resumes_at_tp2_pp2_and_on_one_process(saved, tmp_path):
    ckpt = str(saved)
    meta = checkpoint.read_meta(ckpt)
    assert meta["format"] == 3 and sorted(meta["files"]) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    split = [k for k, t in meta["tensors"].items() if len({s["file"] for s in t["slices"]}) == 2]
    assert any(k.startswith("exp_avg/layers.") for k in split), split  # ZeRO-3 cuts unit-wise
    one = run_world(train_runs, 1, {"ref": resume_config(str(tmp_path / "ref"), 1),
                                    "one": resume_config(str(tmp_path / "one"), 1, ckpt)})[0]
    want = tail(one["ref"], since=3)
    assert len(one["one"]["losses"]) == STEPS - 3
    assert_same_run(tail(one["one"]), want, what="one process")
    layout = dict(dp=1, tp=2, pp=2, microbatches=2)
    memory = {"dp4-zero3": (resume_config(str(tmp_path / "m1"), 4, zero=3), str(tmp_path / "m1" / "ck")),
              "tp2-pp2": (resume_config(str(tmp_path / "m2"), 4, **layout), str(tmp_path / "m2" / "ck")),
              "dp2-tp2-zero1": (resume_config(str(tmp_path / "m3"), 4, dp=2, tp=2, zero=1),
                                str(tmp_path / "m3" / "ck"))}
    got = run_world(resume_and_measure, 4, {"b": resume_config(str(tmp_path / "b"), 4, ckpt, **layout)},
                    memory, timeout_s=400)
    assert_same_run(tail(got[0]["b"]), want, what="tp2 x pp2")
    for rank, out in enumerate(got):
        for name, m in out["memory"].items():
            what = f"{name} rank {rank}: {m}"
            assert m["restored"], what
            assert m["load_extra"] > 0, what  # the tracker sees the slices read
            for phase in ("save_extra", "load_extra"):  # the largest tensor bounds the extra bytes
                assert m[phase] <= 1.1 * m["largest"], (phase, what)
                if name == "dp4-zero3":  # the bound: model / 4 + largest tensor + 10%
                    assert m["share"] + m[phase] <= 1.1 * (m["model"] / 4 + m["largest"]), (phase, what)
                else:  # the rank's share + the largest tensor
                    assert m[phase] <= m["largest"], (phase, what)


def test_incomplete_checkpoints_are_refused_before_launch(saved, tmp_path, capsys):
    def damaged(case: str, damage) -> Path:
        copy = tmp_path / case
        shutil.copytree(saved, copy)
        damage(copy)
        return copy

    name = "param/layers.1.mlp.w2.weight"

    def drop_slice(d: Path) -> None:
        index = json.loads((d / "meta.json").read_text())
        index["tensors"][name]["slices"].pop()
        (d / "meta.json").write_text(json.dumps(publish.seal(index)))  # sealed: the coverage check speaks

    cases = {"no-index": (lambda d: (d / "meta.json").unlink(), "its index meta.json is missing"),
             "no-slice": (drop_slice, f"the slices of tensor {name!r} do not cover it"),
             "no-file": (lambda d: (d / "rank-00001.safetensors").unlink(), "rank-00001.safetensors is missing")}
    for case, (damage, message) in cases.items():
        ckpt = damaged(case, damage)
        assert main(["train", *TINY, "--steps", "4", "--run-dir", str(tmp_path / "run"),
                     "--resume", str(ckpt)]) == 2, case
        err = capsys.readouterr().err
        assert message in err and str(ckpt) in err and "Traceback" not in err, (case, err)
    # Tools read the new format: export assembles each whole tensor from its slices.
    assert main(["export", str(saved), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    _, tensors = checkpoint.verify(saved, checkpoint_model(saved))
    assert torch.equal(exported["lm_head.weight"], tensors["param/output.weight"])


def checkpoint_model(directory):
    from paratrain.models.gpt import GPTConfig

    return GPTConfig(**checkpoint.read_meta(directory)["model"])
