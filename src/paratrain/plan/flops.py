"""FLOPs of a training step, counted as Megatron-LM does (Narayanan et al. 2021).

Per block and forward pass 2·T·(weights of its matmuls) plus 4·T·s·h for QK^T and
softmax·V (causal masking not discounted), the logits 2·T·h·V; backward costs twice the
forward; full recompute adds one forward of every block, selective recompute one forward
of the attention core. For the standard GPT block this is exactly Megatron's
96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with full recompute; without recompute it is the
72·… formula plus 1.5·B·s·h·V (that formula scales the logits term by 3/4 too, although
the logits are never recomputed). A mixture of experts' blocks count their active
weights: the router, top_k experts and the shared expert (``plan/moe.py``). How long they
take is ``plan/cost.py``'s business.
"""

from __future__ import annotations

from . import mla, moe
from .candidate import Training
from .models import ModelSpec


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int,
                   full_recompute: bool) -> float:
    """Megatron-LM's FLOPs per iteration: 72 (96 with full recompute) · B·s·l·h² ·
    (1 + s/(6h) + V/(16·l·h))."""
    return (96 if full_recompute else 72) * batch * s * layers * h * h * (
        1 + s / (6 * h) + vocab / (16 * layers * h))


def layer_matmuls(model: ModelSpec, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of one block's forward matmuls on one TP rank: the attention's (QKV and
    output projection; MLA's five, ``plan/mla.py``), then the MLP's two (input, output)."""
    h, f = model.d_model, model.ffn_hidden
    mlp_in = 2 if model.gated_mlp else 1
    mlp = [(tokens, h, mlp_in * f // tp), (tokens, f // tp, h)]
    if model.mla is not None:
        return mla.matmuls(model, tokens, tp) + mlp
    kv, q = model.kv_heads_per_rank(tp) * model.head_dim, model.q_dim
    return [(tokens, h, q // tp + 2 * kv), (tokens, q // tp, h)] + mlp


def attention_core_flops(model: ModelSpec, b: int, s_q: int, s_kv: int, tp: int) -> float:
    """QK^T and softmax·V of one block's forward on one TP rank."""
    if model.mla is not None:  # head widths d_n + d_r for QK^T, d_v for softmax·V
        return mla.core_flops(model, b, s_q, s_kv, tp)
    return 4 * b * s_q * s_kv * model.q_dim / tp


def step_flops(model: ModelSpec, training: Training, recompute: str = "none") -> float:
    """FLOPs of one step over all ranks (``none``: the model FLOPs MFU is quoted in)."""
    tokens, s = training.tokens, training.seq_len
    matmul = sum(2 * m * k * n for m, k, n in layer_matmuls(model, tokens, 1))
    core = attention_core_flops(model, training.global_batch, s, s, 1)
    extra = {"none": 0.0, "selective": core, "full": matmul + core}[recompute]
    logits = 2 * tokens * model.d_model * model.vocab_size
    total = model.n_layers * (3 * (matmul + core) + extra) + 3 * logits
    if model.n_experts:  # a MoE block's active weights (router, top_k experts, shared) for its MLP
        moe_layers = sum(map(model.is_moe, range(model.n_layers)))
        total += moe_layers * (3 + (recompute == "full")) * moe.flops_delta(model, tokens)
    return total
