"""Every rule about model shapes and strategy combinations lives in ``rules.py``: the
config check, the planner's search and the strategies call the same function, so
changing a rule in one place changes what all three accept."""

from __future__ import annotations

import pytest
import torch

from paratrain import rules
from paratrain.layout import LayoutError
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.parallel import tensor
from paratrain.plan.candidate import Training
from paratrain.plan.hardware import Cluster, gpu_preset
from paratrain.plan.models import PRESETS
from paratrain.plan.search import search
from paratrain.train.config import ConfigError, load

SHAPE = rules.Shape(n_heads=4, n_kv_heads=4, n_layers=4, ffn=128)


@pytest.mark.parametrize("shape, split, words", [
    (SHAPE, rules.Split(tp=3), "divide the 4 attention heads"),
    (rules.Shape(8, 3, 2, 96), rules.Split(tp=4), "KV heads"),
    (rules.Shape(4, 4, 2, 102), rules.Split(tp=4), "MLP width ffn_hidden=102"),
    (SHAPE, rules.Split(pp=7), "4 layers cannot be split"),
    (SHAPE, rules.Split(cp=4, seq_len=60), "multiple of 8"),
    (SHAPE, rules.Split(cp=8, seq_len=64, cp_method="ulysses"), "Ulysses"),
])
def test_shape_rules_name_the_fix(shape, split, words):
    with pytest.raises(LayoutError, match=words):
        rules.check_split(shape, split)


def test_replicated_kv_heads_and_uneven_stages_are_accepted():
    rules.check_split(rules.Shape(8, 2, 5, 128), rules.Split(tp=4, pp=2))


@pytest.mark.parametrize("call, words", [
    (lambda: rules.tied_embeddings(True, pp=2, zero=0), "pipeline stage"),
    (lambda: rules.tied_embeddings(True, pp=1, zero=3), "ZeRO shards"),
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
