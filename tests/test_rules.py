"""Every rule about model shapes and strategy combinations lives in ``rules.py``: the
config check, the planner's search and the strategies call the same function, so
changing a rule in one place changes what all three accept."""

from __future__ import annotations

import pytest
import torch

from paratrain import rules
from paratrain.layout import Layout, LayoutError
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.shape import ModelShape
from paratrain.parallel import tensor
from paratrain.plan.candidate import Training
from paratrain.plan.hardware import Cluster, gpu_preset
from paratrain.plan.models import PRESETS
from paratrain.plan.search import search
from paratrain.train.config import ConfigError, load



def shape(n_heads: int, n_kv_heads: int, n_layers: int, ffn: int) -> ModelShape:
    return ModelShape(n_layers=n_layers, d_model=16 * n_heads, n_heads=n_heads,
                      n_kv_heads=n_kv_heads, ffn_hidden=ffn, vocab_size=256)


SHAPE = shape(n_heads=4, n_kv_heads=4, n_layers=4, ffn=128)


@pytest.mark.parametrize("shape, layout, choices, words", [
    (SHAPE, Layout(tp=3), {}, "divide the 4 attention heads"),
    (shape(12, 6, 2, 96), Layout(tp=4), {}, "KV heads"),
    (shape(4, 4, 2, 102), Layout(tp=4), {}, "MLP width ffn_hidden=102"),
    (SHAPE, Layout(pp=7), {}, "4 layers cannot be split"),
    (SHAPE, Layout(cp=4), dict(seq_len=60), "multiple of 8"),
    (SHAPE, Layout(cp=8), dict(seq_len=64, cp_method="ulysses"), "Ulysses"),
])
def test_shape_rules_name_the_fix(shape, layout, choices, words):
    with pytest.raises(LayoutError, match=words):
        rules.check_split(shape, layout, **choices)


def test_replicated_kv_heads_and_uneven_stages_are_accepted():
    rules.check_split(shape(8, 2, 5, 128), Layout(tp=4, pp=2))


@pytest.mark.parametrize("call, words", [
    (lambda: rules.tied_embeddings(True, pp=2, zero=2), "tied embeddings under a pipeline with ZeRO-2"),
    (lambda: rules.virtual_stages(2, "1f1b"), "interleaved"),
    (lambda: rules.sequence_parallel(True, tp=1, cp=1, seq_len=64), "--tp > 1"),
    (lambda: rules.sequence_parallel(True, tp=2, cp=2, seq_len=6), "divisible by 4"),
])
def test_combination_rules_name_the_fix(call, words):
    with pytest.raises(LayoutError, match=words):
        call()


def test_one_rule_changed_in_one_place_moves_config_planner_and_strategy(monkeypatch, tmp_path):
    """Forbid tp=2 in ``rules.heads`` only: train's config, the planner's search and the
    tensor-parallel split all refuse it, with the rule's own words."""
    original = rules.heads

    def stricter(n_heads: int, n_kv_heads: int, tp: int) -> None:
        if tp == 2:
            raise LayoutError("tp=2 is forbidden by the changed rule")
        original(n_heads, n_kv_heads, tp)

    # Before the change, all three accept tp=2.
    base = {"preset": "tiny", "tp": 2, "nproc": 2, "seq_len": 32, "run_dir": str(tmp_path)}
    load(None, base).validate()
    model, training = PRESETS["llama3-8b"], Training(64, 2048)
    cluster = Cluster(gpu_preset("h100-80g"), 16)
    assert any(p.cand.tp == 2 for p in search(model, training, cluster).plans)
    tiny = GPT(GPTConfig(d_model=32, n_layers=1, n_heads=4, ffn_hidden=64, max_seq_len=16))
    tensor._check_model(tiny, tiny.description(), 2)

    monkeypatch.setattr(rules, "heads", stricter)
    with pytest.raises(ConfigError, match="forbidden by the changed rule"):
        load(None, base).validate()
    result = search(model, training, cluster)
    assert result.plans and not any(p.cand.tp == 2 for p in result.plans)
    assert any("forbidden by the changed rule" in reason for reason in result.rejected)
    with pytest.raises(LayoutError, match="forbidden by the changed rule"):
        tensor._check_model(tiny, tiny.description(), 2)
    torch.manual_seed(0)  # nothing else changed: tp=4 still splits
    tensor._check_model(tiny, tiny.description(), 4)


def test_the_ffn_default_has_one_home(monkeypatch, tmp_path):
    """The derived MLP width (8/3 d_model, rounded up to a multiple of 32) is
    ``shape.default_ffn``: a change there reaches the trainer's model, train's config and
    the planner's reading of a shape that gives no ffn_hidden."""
    from paratrain.models import shape as shape_module
    from paratrain.plan.models import from_toml

    toml = tmp_path / "m.toml"
    toml.write_text("[model]\nn_layers = 2\nd_model = 96\nn_heads = 4\n")
    for multiple, ffn in ((32, 256), (48, 288)):
        monkeypatch.setattr(shape_module, "FFN_MULTIPLE", multiple)
        assert GPTConfig(d_model=96).ffn_dim == ffn
        assert load(str(toml), {"run_dir": str(tmp_path)}).validate().model.ffn_dim == ffn
        assert from_toml(toml).ffn_hidden == ffn
        assert GPT(GPTConfig(d_model=96, n_layers=1, n_heads=4)).layers[0].mlp.w1.out_features == ffn


def test_the_interleave_and_batch_rules_have_one_home(monkeypatch, tmp_path):
    """``rules.interleaved_microbatches`` and ``rules.batch``, changed in one place, move
    train's config, the planner and the schedule builder or the sampler alike."""
    from paratrain.parallel.pipeline.schedules import ScheduleError, check
    from paratrain.train.data import DistributedSampler

    interleaved = {"preset": "tiny", "pp": 2, "nproc": 2, "schedule": "interleaved",
                   "virtual_stages": 2, "global_batch": 4, "micro_batch": 1, "seq_len": 32,
                   "run_dir": str(tmp_path)}
    batch = {"preset": "tiny", "dp": 2, "nproc": 2, "global_batch": 6, "seq_len": 32,
             "run_dir": str(tmp_path)}
    model, cluster = PRESETS["llama3-8b"], Cluster(gpu_preset("h100-80g"), 16)
    training = Training(48, 2048)
    load(None, interleaved).validate()
    load(None, batch).validate()
    check("interleaved", 2, 4, 2)
    DistributedSampler(num_samples=100, global_batch=6, dp_rank=0, dp_size=2)
    found = search(model, training, cluster).plans
    assert any(p.cand.schedule == "interleaved" and p.cand.microbatches == 6 for p in found)
    assert any(p.cand.dp == 2 for p in found)

    def no_interleave(microbatches: int, pp: int) -> None:
        if microbatches < 8:
            raise LayoutError("the changed interleave rule")

    def no_dp2(global_batch: int, dp: int, micro_batch: int = 1) -> None:
        if dp == 2:
            raise LayoutError("the changed batch rule")

    monkeypatch.setattr(rules, "interleaved_microbatches", no_interleave)
    monkeypatch.setattr(rules, "batch", no_dp2)
    with pytest.raises(ConfigError, match="the changed interleave rule"):
        load(None, interleaved).validate()
    with pytest.raises(ScheduleError, match="the changed interleave rule"):
        check("interleaved", 2, 4, 2)
    with pytest.raises(ConfigError, match="the changed batch rule"):
        load(None, batch).validate()
    with pytest.raises(LayoutError, match="the changed batch rule"):
        DistributedSampler(num_samples=100, global_batch=6, dp_rank=0, dp_size=2)
    found = search(model, training, cluster).plans
    assert not any(p.cand.schedule == "interleaved" and p.cand.microbatches == 6 for p in found)
    assert not any(p.cand.dp == 2 for p in found) and any(p.cand.dp == 4 for p in found)
