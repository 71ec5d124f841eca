"""A model's shape: the one vocabulary the planner, the rules, the strategies and
``GPTConfig`` share, with the rules that derive one number from others.

Torch-free, so that ``paratrain plan`` reads it without importing torch. ``GPTConfig``
(the trainer's model config) gives its shape as ``cfg.shape``; the planner's ``ModelSpec``
is a ``ModelShape`` plus a name and cost methods; ``rules.check_split`` and the strategies'
``ModelDescription`` read one. Every count here is exact for paratrain's GPT and for the
GPT-2/3, NeoX and BLOOM style blocks the planner also models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..stages import head_costs, pipeline_split, stage_layer_counts

FFN_MULTIPLE = 32
"""The derived SwiGLU width is rounded up to a multiple of this."""


def default_ffn(d_model: int) -> int:
    """The SwiGLU MLP width a shape gets when it gives none: 8/3 d_model (the gated MLP's
    three matrices then hold as many weights as a 4 d_model GELU MLP's two), rounded up
    to a multiple of ``FFN_MULTIPLE``."""
    return FFN_MULTIPLE * math.ceil(8 * d_model / 3 / FFN_MULTIPLE)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer: the numbers that set its memory and FLOPs."""

    n_layers: int
    """Transformer blocks."""
    d_model: int
    """Width of the residual stream h."""
    n_heads: int
    """Attention (query) heads a."""
    n_kv_heads: int
    """Key/value heads (equal to n_heads without grouped-query attention)."""
    ffn_hidden: int
    """Hidden width of the MLP."""
    vocab_size: int
    """Tokens in the vocabulary V."""
    max_seq_len: int = 2048
    """Longest sequence the model takes (its rotary tables or position embeddings)."""
    tie_embeddings: bool = False
    """The output projection shares the token embedding matrix."""
    gated_mlp: bool = True
    """SwiGLU MLP (gate, up, down: 3 matrices) instead of a GELU MLP (up, down)."""
    bias: bool = False
    """Linear layers and norms carry biases (GPT-2/3, NeoX, BLOOM)."""
    norm: str = "rmsnorm"
    """``rmsnorm`` (weight only) or ``layernorm`` (weight and bias)."""
    learned_pos: bool = False
    """Learned absolute position embeddings (max_seq_len x d_model) instead of RoPE/ALiBi."""
    dropout: bool = False
    """Trained with dropout (its masks are stored activations)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2); ``bias`` already
    includes them."""
    qk_norm: bool = False
    """RMSNorm weights over each head's queries and keys (Qwen3)."""
    n_experts: int = 0
    """Routed experts of each mixture-of-experts block (0: dense)."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Hidden width of each routed expert."""
    shared_ffn: int = 0
    """Hidden width of the shared expert (0: none)."""
    shared_gate: bool = False
    """A sigmoid gate (d_model weights) on the shared expert's output."""
    moe_every: int = 1
    """Block i is a mixture of experts when (i + 1) % moe_every == 0 ..."""
    moe_first_dense: int = 0
    """... and i >= moe_first_dense."""
    explicit_head_dim: int = 0
    """Each head's width where it is not d_model / n_heads (Qwen3's larger models, Mistral
    NeMo, Gemma: q and the attention output are n_heads x head_dim wide); planner-only,
    as train's GPT derives it. 0: d_model / n_heads."""

    def __post_init__(self) -> None:
        name = getattr(self, "name", "") or "model"
        if self.explicit_head_dim < 0:
            raise ValueError(f"{name}: explicit_head_dim={self.explicit_head_dim} must be >= 0")
        if not self.explicit_head_dim and self.d_model % self.n_heads:
            raise ValueError(f"{name}: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"{name}: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"{name}: norm must be 'rmsnorm' or 'layernorm'")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output: n_heads x head_dim (d_model
        unless ``explicit_head_dim``)."""
        return self.n_heads * self.head_dim

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each TP rank holds: split when there are at least tp, else one replica."""
        return max(self.n_kv_heads // tp, 1)

    # ---- parameter counts ----------------------------------------------------------------
    def _norm_params(self) -> int:
        return self.d_model * (2 if self.norm == "layernorm" else 1)

    @lru_cache(maxsize=64)  # noqa: B019 - shapes are few, frozen and hashable
    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one block on one TP rank (norms and row-parallel biases replicated)."""
        h, f, q = self.d_model, self.ffn_hidden, self.q_dim
        kv = self.kv_heads_per_rank(tp) * self.head_dim
        mlp_in = 2 if self.gated_mlp else 1
        weights = h * q // tp * 2 + 2 * h * kv + (mlp_in + 1) * h * f // tp
        biases = (q // tp + 2 * kv + h + mlp_in * f // tp + h) if self.bias else self.qkv_bias_params(tp)
        qk_norms = 2 * self.head_dim if self.qk_norm else 0
        return weights + biases + 2 * self._norm_params() + qk_norms

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture of experts."""
        return (self.n_experts > 0 and layer >= self.moe_first_dense
                and (layer + 1) % self.moe_every == 0)

    def moe_layer_params(self) -> int:
        """Parameters one mixture-of-experts block has beyond a dense block's, all experts
        counted (its dense MLP replaced by the router, the experts and the shared expert)."""
        h, gated = self.d_model, 3 if self.gated_mlp else 2
        moe = h * self.n_experts + self.n_experts * 3 * h * self.expert_ffn
        moe += 3 * h * self.shared_ffn + (h if self.shared_gate else 0)
        return moe - gated * h * self.ffn_hidden

    def active_params(self) -> int:
        """Parameters one token's forward uses: of each MoE block only top_k experts."""
        idle = (self.n_experts - self.top_k) * 3 * self.d_model * self.expert_ffn
        return self.num_params() - idle * sum(map(self.is_moe, range(self.n_layers)))

    def qkv_bias_params(self, tp: int = 1) -> int:
        """The query, key and value biases of one block on one TP rank (split like their
        weights' rows); 0 without ``qkv_bias``."""
        return self.q_dim // tp + 2 * self.kv_heads_per_rank(tp) * self.head_dim if self.qkv_bias else 0

    def embedding_params(self, tp: int = 1) -> int:
        """Vocab-parallel token embedding (plus replicated position embeddings)."""
        pos = self.max_seq_len * self.d_model if self.learned_pos else 0
        return self.vocab_size * self.d_model // tp + pos

    def head_params(self, tp: int = 1, own_copy: bool = False) -> int:
        """Final norm and output projection; a tied projection costs nothing unless this
        rank keeps ``own_copy`` (the last pipeline stage, away from the embedding)."""
        proj = self.vocab_size * self.d_model // tp
        return self._norm_params() + (proj if own_copy or not self.tie_embeddings else 0)

    def num_params(self) -> int:
        """Total parameters, tied embeddings counted once."""
        moe = sum(map(self.is_moe, range(self.n_layers))) * self.moe_layer_params()
        return (self.n_layers * self.layer_params(1) + moe + self.embedding_params(1)
                + self.head_params(1))

    # ---- pipeline cut --------------------------------------------------------------------
    @lru_cache(maxsize=64)  # noqa: B019 - as layer_params; the planner asks per candidate
    def stage_costs(self) -> tuple[float, float]:
        """The embedding's and the head's cost, in blocks, that an uneven pipeline cut
        balances (``paratrain.stages``)."""
        pos = self.max_seq_len * self.d_model if self.learned_pos else 0
        return head_costs(self.vocab_size, self.d_model, self.layer_params(1), pos)

    def stage_runs(self, pp: int, v: int = 1) -> list[range]:
        """The blocks of each of the pp x v virtual stages, as train cuts them and plan
        counts them."""
        return pipeline_split(self.n_layers, pp, v, *self.stage_costs())

    @lru_cache(maxsize=1 << 12)  # noqa: B019 - as stage_costs
    def stage_layer_counts(self, pp: int, v: int = 1) -> tuple[int, ...]:
        """Blocks each pipeline rank holds (virtual stages r, r + pp, ...)."""
        return stage_layer_counts(self.n_layers, pp, v, *self.stage_costs())
