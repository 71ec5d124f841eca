"""The plain GPT: shapes, parameter counts, loss at initialisation."""

import math

import pytest
import torch

from paratrain.models.gpt import GPT, GPTConfig, PRESETS, preset


def test_param_count_matches_formula_with_gqa_and_tied_embeddings():
    for cfg in [*PRESETS.values(), preset("tiny", tie_embeddings=True), preset("tiny", n_kv_heads=0)]:
        with torch.device("meta"):  # the Llama 3 presets have billions of parameters
            assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (4, 32))
    loss = model(tokens, tokens) / tokens.numel()
    assert abs(loss.item() - math.log(256)) < 0.1


def test_positions_select_rope_rows():
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"])
    tokens = torch.randint(0, 256, (2, 16))
    default = model(tokens, tokens)
    explicit = model(tokens, tokens, positions=torch.arange(16))
    shifted = model(tokens, tokens, positions=torch.arange(16) + 5)  # RoPE is relative
    spread = model(tokens, tokens, positions=torch.arange(16) * 2)
    assert torch.equal(default, explicit)
    torch.testing.assert_close(default, shifted, rtol=1e-5, atol=1e-5)
    assert not torch.equal(default, spread)


@pytest.mark.parametrize("bad, words", [(dict(d_model=65), "divisible"), (dict(n_kv_heads=3), "multiple")])
def test_bad_shapes_are_rejected(bad, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**{**dict(d_model=64, n_heads=4), **bad})


def test_swiglu_keeps_gate_and_up_and_matches_autograd_bitwise():
    """The block's SwiGLU saves gate and up only (silu recomputed in backward, 3 ffn-wide
    tensors per token with w2's input, as the planner counts) and its gradients are
    bitwise those of autograd's unfused ``F.silu(gate) * up``, in fp32 and bf16."""
    import torch.nn.functional as F

    from paratrain.models.gpt import _SwiGLUProduct

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        gate, up = (torch.randn(8, 48, dtype=dtype, requires_grad=True) for _ in range(2))
        grad = torch.randn(8, 48, dtype=dtype)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fused = _SwiGLUProduct.apply(gate, up)
        assert len(saved) == 2 and saved[0] is gate and saved[1] is up
        expected_grads = torch.autograd.grad(F.silu(gate) * up, (gate, up), grad)
        assert torch.equal(fused, F.silu(gate) * up)
        for got, want in zip(torch.autograd.grad(fused, (gate, up), grad), expected_grads):
            assert torch.equal(got, want), dtype
