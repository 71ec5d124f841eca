"""A plain Llama-style GPT: RMSNorm, RoPE, causal attention with grouped KV heads, SwiGLU.

Written with ordinary ``nn.Linear`` / ``nn.Embedding`` layers and no parallel code, so
each strategy can parallelize it after it is built. Three seams exist for them:
``Attention.core`` (the softmax(QK^T)V part, which context parallelism replaces),
``GPT.loss_fn`` (vocab-parallel cross-entropy replaces it), and the split of ``forward``
into ``embed`` / ``layers`` / ``head`` (pipeline stages run slices of it).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoE
from .rope import apply_rope, rope_tables
from .shape import ModelShape, default_ffn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256: raw bytes)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; d_model must divide evenly among them."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means one per query head."""
    ffn_hidden: int = 0
    """Hidden width of the SwiGLU MLP; 0 means ``shape.default_ffn``: 8/3 * d_model rounded
    up to a multiple of 32."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output projection."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    rope_scaling: str = ""
    """Rotary frequency scaling: '' (none) or 'llama3:FACTOR:LOW:HIGH:ORIGINAL_MAX_LEN'
    (Llama 3.1's long-context scaling)."""
    sliding_window: int = 0
    """Mistral's attention window (0: none). paratrain computes full attention, so sequences
    longer than the window are refused rather than silently attended in full."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before the rotation (Qwen3)."""
    n_experts: int = 0
    """Routed experts of each mixture-of-experts block (0: every block has the dense MLP;
    models/moe.py)."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Hidden width of each routed expert's SwiGLU (0: ffn_hidden)."""
    shared_ffn: int = 0
    """Hidden width of the shared expert every token also passes through (0: none;
    several shared experts of one width act as one of their summed width)."""
    shared_gate: bool = False
    """Scale the shared expert's output by sigmoid(w · x) per token (Qwen2-MoE)."""
    moe_every: int = 1
    """Every moe_every-th block is a mixture of experts (block i when (i + 1) % moe_every
    == 0; Qwen's decoder_sparse_step)."""
    moe_first_dense: int = 0
    """The first moe_first_dense blocks keep the dense MLP (DeepSeek's first_k_dense_replace)."""
    router: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: 'softmax' over the experts (Mixtral, Qwen) or 'sigmoid' per
    expert (DeepSeek-V3)."""
    norm_topk: bool = True
    """Renormalise the chosen k scores to sum to one (Mixtral; Qwen's norm_topk_prob)."""
    routed_scale: float = 1.0
    """Factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (0: off); its exact form is in models/moe.py."""
    bias_update: float = 0.0
    """Step of the selection bias toward balance after each optimizer step (0: off;
    DeepSeek-V3's auxiliary-loss-free balancing)."""
    capacity_factor: float = 0.0
    """Each expert takes at most capacity_factor · T · top_k / n_experts of a sequence's
    T · top_k assignments, the rest dropped (0: dropless)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router={self.router!r}: 'softmax' or 'sigmoid'")
        if self.n_experts and self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be at least 1")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or default_ffn(self.d_model)

    @property
    def expert_dim(self) -> int:
        return self.expert_ffn or self.ffn_dim

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` is a mixture of experts."""
        return (self.n_experts > 0 and layer >= self.moe_first_dense
                and (layer + 1) % self.moe_every == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe(i)]

    @property
    def shape(self) -> ModelShape:
        """This model's shape, in the vocabulary the planner and the rules read (with the
        key/value heads and MLP width resolved)."""
        return ModelShape(n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                          n_kv_heads=self.kv_heads, ffn_hidden=self.ffn_dim,
                          vocab_size=self.vocab_size, max_seq_len=self.max_seq_len,
                          tie_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias,
                          qk_norm=self.qk_norm, n_experts=self.n_experts,
                          top_k=self.top_k if self.n_experts else 0,
                          expert_ffn=self.expert_dim if self.n_experts else 0,
                          shared_ffn=self.shared_ffn, shared_gate=self.shared_gate,
                          moe_every=self.moe_every, moe_first_dense=self.moe_first_dense)

    def num_params(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        return self.shape.num_params()


PRESETS: dict[str, GPTConfig] = {
    # For tests: runs a step in milliseconds.
    "tiny": GPTConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=128),
    # A shape given whole by its fields (models.shape_base) starts from the defaults alone.
    "custom": GPTConfig(),
    # The demo default: ~2.46M parameters, learns visibly in a minute on two CPU processes.
    "small": GPTConfig(d_model=192, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=512, max_seq_len=128),
    # The planner's Llama 3 presets (plan/models.py), at full size with random weights:
    # built on the meta device, so each rank materialises only its share.
    **{name: GPTConfig(vocab_size=128256, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=8,
                       ffn_hidden=ffn, max_seq_len=8192, rope_theta=500000.0)
       for name, layers, d, heads, ffn in [("llama3-8b", 32, 4096, 32, 14336),
                                           ("llama3-70b", 80, 8192, 64, 28672),
                                           ("llama3-405b", 126, 16384, 128, 53248)]},
}


def preset(name: str, **overrides) -> GPTConfig:
    """A named configuration, or a Hugging Face model directory's (``models/hf.py``),
    optionally with some fields replaced."""
    from . import hf

    if hf.is_model_dir(name):
        fixed = sorted(set(overrides) - {"max_seq_len", "init_std"})
        if fixed:
            raise ValueError(f"{', '.join(fixed)}: fixed by the weights of the Hugging Face model "
                             f"at {name}; drop the override (only max_seq_len may change)")
        return replace(hf.read_config(name), **overrides)
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}, or a "
                         f"local Hugging Face model directory (config.json + safetensors)")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast: the mean of squares loses precision.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed for one tensor: a stable hash of the run's seed and its name."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def init_tensor(cfg: GPTConfig, name: str, shape: tuple[int, ...], seed: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The initial value of parameter ``name`` (the plain model's name, whole shape).

    Normal(0, init_std) weights, with the residual output projections scaled down by
    sqrt(2 * n_layers) so that the residual stream's variance does not grow with depth;
    norms one, biases zero. Each tensor has its own generator, so its value does not
    depend on which other tensors a rank holds: any layout's shares make up the same model.
    """
    out = torch.empty(shape, device=device)
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if name.endswith((".bias", "expert_bias")):
        return out.zero_()
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std /= math.sqrt(2 * cfg.n_layers)
    generator = torch.Generator(device=out.device).manual_seed(tensor_seed(seed, name))
    return out.normal_(0.0, std, generator=generator)


class CausalAttention(nn.Module):
    """softmax(Q K^T / sqrt(d)) V with a causal mask; q, k, v are (batch, heads, seq, dim)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped KV heads: each serves n_heads / kv_heads queries
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.core = CausalAttention()
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard with fewer heads works.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _SwiGLUProduct(torch.autograd.Function):
    """silu(gate) * up, saving only gate and up and recomputing silu in backward (as
    Megatron-core's fused SwiGLU does): the MLP keeps 3 tensors of the ffn width per token
    (gate, up, and the product w2 saves) instead of 4. The backward runs the same kernels
    as autograd's unfused graph, so gradients are bitwise those of ``F.silu(gate) * up``."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return d_gate, F.silu(gate).mul_(grad)  # in place: one temporary, not two


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig, hidden: int = 0):
        super().__init__()
        hidden = hidden or cfg.ffn_dim
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_SwiGLUProduct.apply(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class CrossEntropySum(nn.Module):
    """Sum of token cross-entropies, skipping targets equal to IGNORE_INDEX.

    Summing (not averaging) lets the caller divide by the token count of the whole global
    batch, which is what makes sharded and masked batches match single-process training.
    """

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int | None = None):
        """``seed`` sets the initial weights (``init_tensor``); None draws it from torch's
        global generator, so ``torch.manual_seed`` decides as usual. Built under
        ``torch.device("meta")`` the model has shapes and no storage: ``parallelize`` then
        gives each rank only its share, filled from a source (train/materialize.py)."""
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loss_fn = CrossEntropySum()
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.output.weight.is_meta:
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Every parameter drawn by ``init_tensor`` from its own generator."""
        if seed is None:
            seed = int(torch.randint(1 << 62, (1,), device="cpu"))
        for name, p in self.named_parameters():
            p.copy_(init_tensor(self.cfg, name, tuple(p.shape), seed, p.device))

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the rotary tables on ``device`` (a model built on meta has none)."""
        cos, sin = rope_tables(self.cfg)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def description(self):
        """Where things are, for the strategies (models/description.py)."""
        from .description import gpt_description

        return gpt_description(self.cfg)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_cos[positions], self.rope_sin[positions]

    def head(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and summed loss."""
        return self.loss_fn(self.output(self.norm(h)), targets)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Residual stream after the last block. ``positions`` are the tokens' places in the
        full sequence (default 0..seq-1); a rank holding a slice of the sequence passes its own."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.rope(positions)
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Summed cross-entropy of predicting ``targets`` from ``tokens`` (batch, seq)."""
        return self.head(self.hidden(tokens, positions), targets)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.hidden(tokens)))
