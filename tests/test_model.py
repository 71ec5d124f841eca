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
