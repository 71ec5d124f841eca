"""Mixtures of experts: the model against transformers (Mixtral, Qwen2-MoE, Qwen3-MoE) and
the export back, the balancing loss exactly as docs/moe.md writes it (per sequence, so
that no layout or accumulation changes it), and expert parallelism against one process."""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from helpers import RTOL, assert_same_run, assert_tensors_close, tiny_config, train_runs
from paratrain.models import hf
from paratrain.models.gpt import GPT, GPTConfig
from paratrain.models.moe import MoE

MOE = dict(n_experts=4, top_k=2, expert_ffn=64)
"""The tiny preset with 4 experts of width 64, 2 per token, in every block."""


def _families():
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    shape = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2)
    return {
        "mixtral": MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)),
        "qwen2_moe": Qwen2MoeForCausalLM(Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, mlp_only_layers=[0], **shape)),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
            decoder_sparse_step=2, **shape)),
    }


def test_logits_equal_transformers_and_the_export_loads_back(tmp_path):
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (2, 12))
    for name, theirs in _families().items():
        theirs.eval().save_pretrained(tmp_path / name)
        cfg = hf.read_config(tmp_path / name)
        ours = GPT(cfg)
        ours.load_state_dict(hf.load_weights(tmp_path / name, cfg))
        ours.eval()
        with torch.no_grad():
            want = theirs(tokens).logits
            torch.testing.assert_close(ours.logits(tokens), want, rtol=1e-5, atol=1e-5, msg=name)
        out = hf.export(dict(ours.named_parameters()), cfg, tmp_path / f"{name}-out")
        back = type(theirs).from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(tokens).logits, want, rtol=1e-5, atol=1e-5, msg=name)
    assert [cfg.is_moe(i) for i in range(3)] == [False, True, False]  # decoder_sparse_step=2


def _aux_reference(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """Σ over MoE layers and sequences of n_experts · Σ_i f_i P_i, written out directly."""
    captured = []
    hooks = [m.router.register_forward_hook(lambda mod, inp, out: captured.append(out))
             for m in model.modules() if isinstance(m, MoE)]
    model(tokens, tokens)
    for h in hooks:
        h.remove()
    cfg, (b, s) = model.cfg, tokens.shape
    total = torch.zeros(())
    for logits in captured:
        probs = logits.float().softmax(-1).view(b, s, -1)
        chosen = probs.topk(cfg.top_k, -1).indices
        for seq in range(b):
            f = torch.bincount(chosen[seq].flatten(), minlength=cfg.n_experts) / (s * cfg.top_k)
            total = total + cfg.n_experts * (f * probs[seq].mean(0)).sum()
    return total


def test_the_aux_loss_is_per_sequence_and_its_gradient_is_exact():
    """The gradient the router receives is that of CE_sum + coef · T · Σ_seq aux(seq), and
    two microbatches of two sequences give what one of four gives (accumulation)."""
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, aux_loss_coef=0.1, **MOE)
    model = GPT(cfg, seed=1).train()
    tokens = torch.randint(0, 64, (4, 16))
    model(tokens, tokens).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    plain = GPT(cfg, seed=1).train()
    for m in plain.modules():
        if isinstance(m, MoE):
            m.aux_coef = 0.0  # no injection: the reference adds the aux loss by hand
    (plain(tokens, tokens) + 0.1 * 16 * _aux_reference(plain, tokens)).backward()
    assert_tensors_close(injected, {n: p.grad for n, p in plain.named_parameters() if p.requires_grad},
                         RTOL, "aux")
    for half in tokens.split(2):
        model(half, half).backward()
    assert_tensors_close({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, injected, RTOL,
                         "two microbatches")


def _configs(tmp: str, nproc: int, ep: int) -> dict:
    return {"aux": tiny_config(tmp, nproc=nproc, ep=ep, **MOE),
            "bias": tiny_config(tmp, nproc=nproc, ep=ep, aux_loss_coef=0.0, bias_update=0.01, **MOE),
            "accumulate": tiny_config(tmp, nproc=nproc, ep=ep, micro_batch=8 // nproc // 2, **MOE)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_world(train_runs, 1, _configs(str(tmp_path_factory.mktemp("ref")), 1, 1))[0]


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_process(nproc, ep, reference, tmp_path):
    runs = run_world(train_runs, nproc, _configs(str(tmp_path), nproc, ep))
    for name, want in reference.items():
        for rank, got in enumerate(runs):
            assert_same_run(got[name], want, what=f"{name} dp{nproc} ep{ep} rank {rank}")
