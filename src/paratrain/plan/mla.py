"""DeepSeek's multi-head latent attention (MLA) in the planner's counts (docs/plan.md,
"Mixtures of experts"), and the DeepSeek-V3 config.json that needs it.

MLA (DeepSeek-V2 and V3, modelling_deepseek.py) replaces the q, k, v projections of a head
by low-rank latents: with a heads, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim,
d_v = v_head_dim, r_q = q_lora_rank and r_kv = kv_lora_rank,

* queries: q_a (h -> r_q), an RMSNorm over r_q, q_b (r_q -> a·(d_n + d_r)); or one q_proj
  (h -> a·(d_n + d_r)) when q_lora_rank is null;
* keys and values: kv_a_proj_with_mqa (h -> r_kv + d_r: the latent and one rotary key
  shared by every head), an RMSNorm over r_kv, kv_b (r_kv -> a·(d_n + d_v));
* o_proj (a·d_v -> h).

Tensor parallelism splits what is per head (q_b or q_proj, kv_b, o_proj, the attention
core) as Megatron-core's MLA does; the down projections and their norms are small and whole
on every tp rank (Megatron's ``linear_q_down_proj`` / ``linear_kv_down_proj`` are not split).
The attention core has head width d_n + d_r for QK^T and d_v for softmax·V.

``paratrain train`` builds no MLA: a plan with it is planner-only, and ``--out`` refuses it
(``REFUSAL``). DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``) is
not counted: the published 671B / 37B are the main model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..models.hf_config import HFModelError, check_types, read_shape

DEEPSEEK = {"deepseek_v3": "DeepseekV3ForCausalLM"}
"""model_type -> architecture of the latent-attention mixtures of experts the planner reads."""
REFUSAL = ("multi-head latent attention (MLA, DeepSeek) is planner-only: `paratrain train` "
           "builds standard multi-head / grouped-query attention, so no train config can "
           "be written for it")
"""Why ``--out`` writes no config for an MLA model (``export.refusal``)."""


@dataclass(frozen=True)
class LatentAttention:
    """The ranks and head widths of one block's MLA."""

    q_lora_rank: int
    """Width r_q of the query latent; 0: queries come from one q_proj (q_lora_rank null)."""
    kv_lora_rank: int
    """Width r_kv of the key/value latent."""
    qk_rope_dim: int
    """Rotary part d_r of each query and key head (the key's shared by every head)."""
    qk_nope_dim: int
    """Non-rotary part d_n of each query and key head."""
    v_head_dim: int
    """Width d_v of each value head."""

    @property
    def qk_dim(self) -> int:
        """Head width of QK^T: d_n + d_r."""
        return self.qk_nope_dim + self.qk_rope_dim


def params(model, tp: int = 1) -> int:
    """Attention parameters of one MLA block on one tp rank: the down projections and
    latent norms whole, q_b (or q_proj), kv_b and o_proj split by heads."""
    m, h = model.mla, model.d_model
    heads = model.n_heads // tp
    if m.q_lora_rank:
        query = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_dim
    else:
        query = h * heads * m.qk_dim
    kv = h * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank
    kv += m.kv_lora_rank * heads * (m.qk_nope_dim + m.v_head_dim)
    return query + kv + heads * m.v_head_dim * h


def params_delta(model, tp: int = 1) -> int:
    """MLA's attention parameters on one tp rank less the standard attention's that
    ``ModelShape.layer_params`` counts (q, k, v and o; DeepSeek has no attention biases)."""
    kv = model.kv_heads_per_rank(tp) * model.head_dim
    return params(model, tp) - (2 * model.d_model * model.d_model // tp + 2 * model.d_model * kv)


def matmuls(model, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of one block's attention projections on one tp rank, in order."""
    m, h = model.mla, model.d_model
    heads = model.n_heads // tp
    if m.q_lora_rank:
        query = [(tokens, h, m.q_lora_rank), (tokens, m.q_lora_rank, heads * m.qk_dim)]
    else:
        query = [(tokens, h, heads * m.qk_dim)]
    return query + [(tokens, h, m.kv_lora_rank + m.qk_rope_dim),
                    (tokens, m.kv_lora_rank, heads * (m.qk_nope_dim + m.v_head_dim)),
                    (tokens, heads * m.v_head_dim, h)]


def head_dims(model) -> tuple[int, int]:
    """(QK^T head width, softmax·V head width): (d_n + d_r, d_v), or head_dim twice."""
    if model.mla is None:
        return model.head_dim, model.head_dim
    return model.mla.qk_dim, model.mla.v_head_dim


def core_flops(model, b: int, s_q: int, s_kv: int, tp: int) -> float:
    """QK^T and softmax·V of one block's forward on one tp rank:
    2·b·s_q·s_kv·(a/tp)·(d_qk + d_v)."""
    qk, v = head_dims(model)
    return 2 * b * s_q * s_kv * model.n_heads / tp * (qk + v)


def widths(model, tp: int) -> tuple[int, int, int, int]:
    """Elements per token on one tp rank of q, k, v and the attention output (what
    context parallelism exchanges: ring attention k and v, Ulysses all four)."""
    if model.mla is None:
        q = model.n_heads // tp * model.head_dim
        kv = model.kv_heads_per_rank(tp) * model.head_dim
        return q, kv, kv, q
    qk, v = head_dims(model)
    heads = model.n_heads // tp
    return heads * qk, heads * qk, heads * v, heads * v


def stored(model) -> tuple[float, float]:
    """(inside, latent): elements per token one MLA block saves for backward, as
    ``memory.layer_activation_bytes`` counts them. Inside the tp region (split by tp): q,
    k, v and the o_proj input, a·(2(d_n + d_r) + 2·d_v). The latents, outside it (whole
    under plain tp, sequence-split under SP): the query latent and its norm's output
    (2·r_q), the key/value latent and its norm's output (2·r_kv) and the rotary key (d_r)."""
    m = model.mla
    inside = model.n_heads * (2 * m.qk_dim + 2 * m.v_head_dim)
    return inside, 2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_dim


def rope_and_norm_elems(model, tp: int) -> float:
    """Elements per token MLA's elementwise passes read and write beyond the standard
    block's RoPE (``compute.elementwise_bytes``): RoPE on the rotary parts (read and write
    a/tp·d_r query and d_r key elements) and the two latent norms (read and write r_q and r_kv)."""
    m = model.mla
    standard = 2 * (model.d_model // tp + model.kv_heads_per_rank(tp) * model.head_dim)
    rope = 2 * (model.n_heads // tp * m.qk_rope_dim + m.qk_rope_dim)
    return rope + 2 * (m.q_lora_rank + m.kv_lora_rank) - standard


def describe(model) -> str:
    """The attention for the planner's model line ('' for standard attention)."""
    m = model.mla
    if m is None:
        return ""
    query = f"q_lora {m.q_lora_rank}" if m.q_lora_rank else "q_proj"
    return (f", MLA ({query}, kv_lora {m.kv_lora_rank}, qk {m.qk_nope_dim}+{m.qk_rope_dim} "
            f"rope, v {m.v_head_dim}; planner-only: `paratrain train` does not run it)")


HEAD_DIM_REFUSAL = ("a head_dim other than d_model / n_heads is planner-only: `paratrain train` "
                    "builds heads of d_model / n_heads, so no train config can be written for it")
"""Why ``--out`` writes no config for a model with ``explicit_head_dim``."""


def planner_only(model) -> str | None:
    """Why ``paratrain train`` cannot build ``model`` (MLA, or heads wider or narrower than
    d_model / n_heads), or None."""
    if model.mla is not None:
        return REFUSAL
    if model.explicit_head_dim:
        return HEAD_DIM_REFUSAL
    return None


def check_cluster(model, kind: str) -> None:
    """ValueError for a planner-only model on the local cluster, whose memory is
    paratrain's own runtime's (``plan.runtime``), which cannot build it."""
    why = planner_only(model)
    if why and kind == "local":
        raise ValueError(f"{model.name}: --cluster local plans paratrain's own processes, and "
                         f"{why.split(': ', 1)[1]}; plan it on --cluster gpu")


# ---- DeepSeek-V3's config.json -----------------------------------------------------------

_MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_VALUES = {"scoring_func": ("sigmoid", "softmax"), "topk_method": ("noaux_tc", "greedy",
                                                                   "group_limited_greedy")}
"""Routing choices: values, not shapes (the same experts and FLOPs whichever is chosen)."""


def _int(raw: dict, key: str, path: Path, zero_ok: bool = False) -> int:
    value = raw.get(key)
    if type(value) is not int or value < (0 if zero_ok else 1):
        raise HFModelError(f"{path}: {key} must be a {'non-negative' if zero_ok else 'positive'} "
                           f"integer, got {json.dumps(value)}")
    return value


def from_deepseek(raw: dict, path: Path):
    """The ``ModelShape`` (with its experts) and ``LatentAttention`` of a DeepSeek-V3
    config.json: first_k_dense_replace dense blocks of intermediate_size, then MoE blocks
    (every moe_layer_freq-th) of n_routed_experts experts of moe_intermediate_size, top
    num_experts_per_tok, and n_shared_experts of the same width as one shared expert."""
    # MLA's head widths are its own keys; a head_dim key (some exports write d_r) is not
    # hidden / heads, which read_shape would refuse
    shape = read_shape({k: v for k, v in raw.items() if k != "head_dim"}, path)
    check_types(raw, path)
    for key, allowed in _VALUES.items():
        if raw.get(key) is not None and raw[key] not in allowed:
            raise HFModelError(f"{path}: {key} = {json.dumps(raw[key])}; the planner reads "
                               f"{', '.join(allowed)}")
    q_rank = raw.get("q_lora_rank")
    attention = LatentAttention(
        0 if q_rank is None else _int(raw, "q_lora_rank", path),
        *(_int(raw, key, path) for key in _MLA_KEYS))
    experts = _int(raw, "n_routed_experts", path)
    width = _int(raw, "moe_intermediate_size", path)
    top_k = _int(raw, "num_experts_per_tok", path)
    if top_k > experts:
        raise HFModelError(f"{path}: num_experts_per_tok = {top_k} is more than "
                           f"n_routed_experts = {experts}")
    shared = _int(raw, "n_shared_experts", path, zero_ok=True) if "n_shared_experts" in raw else 0
    shape = replace(shape, n_experts=experts, top_k=top_k, expert_ffn=width,
                    shared_ffn=shared * width,
                    moe_every=_int(raw, "moe_layer_freq", path) if "moe_layer_freq" in raw else 1,
                    moe_first_dense=_int(raw, "first_k_dense_replace", path, zero_ok=True)
                    if "first_k_dense_replace" in raw else 0)
    return shape, attention
