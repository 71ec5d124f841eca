"""Sharded initialisation: the model is built without storage and each rank materialises
only its share. Whatever the layout, the weights equal a single process's (seeded
initialiser) or the Hugging Face directory's (read by slice), bit for bit; and a rank's
peak bytes while it initialises, measured from live storages, stay within its share plus
the largest tensor."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distributed import run_world
from helpers import tiny_config
from paratrain import api
from paratrain.accounting import storage_bytes
from paratrain.mesh import Mesh
from paratrain.models import hf
from paratrain.train import checkpoint, task_lm
from paratrain.train.config import load

transformers = pytest.importorskip("transformers")

LAYOUTS = {"dp4-zero3": dict(dp=4, zero=3), "tp2-pp2": dict(tp=2, pp=2, microbatches=2),
           "dp2-tp2-zero2": dict(dp=2, tp=2, zero=2)}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the CPU storages alive during a block, re-read at every torch operation
    (a storage resized to nothing counts nothing); ``end``: those alive at the end."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}
        self.peak = self.end = 0

    def live(self) -> int:
        sizes = {}
        for key, ref in list(self.refs.items()):
            t = ref()
            if t is None:
                del self.refs[key]
            elif (storage := t.untyped_storage()).data_ptr():
                sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.refs[id(t)] = weakref.ref(t)
        self.peak = max(self.peak, self.live())
        return out

    def __exit__(self, *exc):
        self.end = self.live()
        return super().__exit__(*exc)


def initialise(configs: dict) -> dict:
    """Per layout: this rank's peak and resident bytes while building its engine, its
    state's bytes, and the full weights it makes up with the others."""
    out = {}
    for name, cfg in configs.items():
        mesh = Mesh.build(cfg.layout)
        with LiveBytes() as bytes_:
            engine, _ = task_lm.build_engine(cfg, mesh)
        state = engine.state_tensors()
        out[name] = {"peak": bytes_.peak, "end": bytes_.end,
                     "state": storage_bytes([*state["params"], *state["grads"], *state["optim"]]),
                     "weights": engine.full_state_dict()}
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases: their rows are permuted by slice too)."""
    from test_hf import make

    return make(tmp_path_factory.mktemp("hf"), "qwen2")[1]


@pytest.mark.timeout(400)
def test_every_layout_materialises_the_same_weights_within_its_share(hf_dir, tmp_path):
    configs = {}
    for name, layout in LAYOUTS.items():  # each layout from one source, ZeRO-3 from both
        if name != "dp2-tp2-zero2":
            configs[name] = tiny_config(str(tmp_path / name), nproc=4, n_layers=4, **layout)
        if name != "tp2-pp2":
            configs[f"hf/{name}"] = tiny_config(str(tmp_path / f"hf-{name}"), nproc=4, preset=hf_dir, **layout)
    got = run_world(initialise, 4, configs, timeout_s=300)
    for name, cfg in configs.items():
        if name.startswith("hf/"):
            want = hf.load_weights(hf_dir, cfg.model)
        else:  # one process, the whole model, the same seed
            want = api.build_model(cfg).state_dict()
        params = 4 * cfg.model.num_params()
        largest = 4 * max(math.prod(s) for s in checkpoint.expected_shapes(cfg.model).values())
        for rank, out in enumerate(got):
            m = out[name]
            what = f"{name} rank {rank}: peak {m['peak']}, end {m['end']}, state {m['state']}, largest {largest}"
            assert set(m["weights"]) == set(want), what
            for key, value in m["weights"].items():
                assert torch.equal(value, want[key]), (what, key)
            assert m["state"] <= m["end"] <= 1.05 * m["state"] + 4096, what  # what it keeps is its state
            assert m["peak"] <= m["end"] + largest, what  # plus at most the largest tensor
            if name.endswith("dp4-zero3"):  # the bound: model / 4 + largest + 10%
                # (parameters and their gradients: 2 x 4 bytes per parameter, a quarter each)
                assert m["peak"] <= 1.1 * (2 * params / 4 + largest), what


def test_a_plan_that_does_not_fit_here_is_refused_with_both_numbers(tmp_path, capsys, monkeypatch):
    from paratrain.cli import main
    from paratrain.train import preflight

    out = tmp_path / "llama3-8b.toml"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--out", str(out)]) == 0
    assert 'preset = "llama3-8b"' in out.read_text()
    capsys.readouterr()
    monkeypatch.setattr(preflight, "_available_ram", lambda: 64 << 30)
    assert main(["train", "--config", str(out), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    planned = preflight.predicted_memory(load(str(out)).validate()).total
    assert planned > 8 << 30
    assert f"the planner predicts {planned / 2**30:.2f} GiB per rank" in err, err
    assert "available RAM / 8 local ranks is 8.00 GiB" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    # The same check passes a run that fits: the tiny model's prediction is a few MiB.
    cfg = tiny_config(str(tmp_path / "tiny"), nproc=2)
    predicted = preflight.predicted_memory(cfg).total
    assert 0 < predicted < 64 << 20
    preflight.check_memory(cfg, 2)
