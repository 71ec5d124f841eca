"""Hugging Face Llama-family models in and out of paratrain's GPT.

A local model directory (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) of ``LlamaForCausalLM``, ``MistralForCausalLM`` (full
attention) or ``Qwen2ForCausalLM`` (q/k/v biases) becomes a ``GPTConfig`` and a state dict
under paratrain's names; ``export`` writes the reverse, which transformers' ``from_pretrained``
loads. Nothing is downloaded, and transformers itself is not needed here (tests compare
with it).

RoPE convention: transformers rotates the two halves of each head (``rotate_half``: dim i
pairs with i + d/2), paratrain rotates adjacent pairs (2i with 2i + 1). The two are the same
attention once the rows of W_q and W_k (and their biases) are permuted within each head, so
import permutes them and export permutes them back: a round trip is bit-identical.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..paths import is_plain_name
from . import hf_config as hf_config_json
from . import hf_moe
from .gpt import GPTConfig
from .hf_config import (TRAINED, HFModelError, architecture, read_shape, rope_parameters,  # noqa: F401
                        rope_scaling, sliding_window, trainable)

SUPPORTED = tuple(TRAINED.values())


def is_model_dir(name: str) -> bool:
    return Path(name).is_dir() and (Path(name) / "config.json").is_file()


def read_config(directory: str | Path) -> GPTConfig:
    """The GPTConfig of a Hugging Face model directory; HFModelError for anything else.
    The shape comes from the one config.json reader (``models/hf_config.py``), which the
    planner reads too."""
    path = Path(directory) / "config.json"
    raw = hf_config_json.load(path)
    trainable(raw, path)
    shape = read_shape(raw, path)
    return GPTConfig(
        vocab_size=shape.vocab_size, d_model=shape.d_model, n_layers=shape.n_layers,
        n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, ffn_hidden=shape.ffn_hidden,
        max_seq_len=shape.max_seq_len, tie_embeddings=shape.tie_embeddings, qkv_bias=shape.qkv_bias,
        rope_theta=float(rope_parameters(raw).get("rope_theta", 10000.0)),
        norm_eps=raw.get("rms_norm_eps", 1e-6), rope_scaling=rope_scaling(raw, path.parent),
        sliding_window=sliding_window(raw, path.parent), **hf_moe.read_fields(raw, path))


# ---- weights ------------------------------------------------------------------------------

_BLOCK = {  # paratrain name in a block -> transformers name in a decoder layer
    "attn_norm.weight": "input_layernorm.weight", "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight", "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight", "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias", "attn.wv.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def names(cfg: GPTConfig) -> dict[str, str]:
    """paratrain name -> transformers name for every tensor of a model of this shape, but
    the routed experts' (``stacked_names``)."""
    out = {k: v for k, v in _TOP.items() if not (cfg.tie_embeddings and k == "output.weight")}
    moe = hf_moe.block_names(cfg) if cfg.n_experts else {}
    for i in range(cfg.n_layers):
        block = {**_BLOCK, **(_QK_NORM if cfg.qk_norm else {})}
        if cfg.is_moe(i):
            block = {k: v for k, v in block.items() if not k.startswith("mlp.")} | moe
        for ours, theirs in block.items():
            if ours.endswith(".bias") and not cfg.qkv_bias:
                continue
            out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return out


def stacked_names(cfg: GPTConfig) -> dict[str, tuple[str, ...]]:
    """paratrain's stacked expert tensors (expert, out, in) -> transformers' one tensor
    per expert, in expert order."""
    return hf_moe.stacked_names(cfg) if cfg.n_experts else {}


def _rope_rows(head_dim: int, heads: int, to_interleaved: bool) -> torch.Tensor:
    """Row order turning rotate-half rows into adjacent-pair rows (or back)."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()
    if not to_interleaved:
        within = torch.argsort(within)
    return (torch.arange(heads)[:, None] * head_dim + within[None, :]).flatten()


def _permute_rope(name: str, t: torch.Tensor, cfg: GPTConfig, to_interleaved: bool) -> torch.Tensor:
    if "_norm." in name and ".attn." in name:  # q_norm, k_norm: one head's rows
        return t[_rope_rows(cfg.head_dim, 1, to_interleaved)]
    if ".wq." in name:
        return t[_rope_rows(cfg.head_dim, cfg.n_heads, to_interleaved)]
    if ".wk." in name:
        return t[_rope_rows(cfg.head_dim, cfg.kv_heads, to_interleaved)]
    return t


def weight_files(directory: str | Path) -> dict[str, str]:
    """transformers tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    root = Path(directory)
    if (root / "model.safetensors").is_file():  # read first, as transformers reads it
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            return {key: "model.safetensors" for key in f.keys()}
    index = root / INDEX
    if index.is_file():
        return read_weight_map(index)
    raise HFModelError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                       f"(pytorch_model.bin is not read: it is a pickle)")


INDEX = "model.safetensors.index.json"


def read_weight_map(index: Path) -> dict[str, str]:
    """A sharded model's ``weight_map`` (tensor name -> shard file), refused (HFModelError)
    unless every shard is a plain file name: the index is input, and a name like
    ``../x`` or ``/x`` would have paratrain read, or ``export --overwrite`` delete, a file
    outside the model's directory."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise HFModelError(f"{index}: not a JSON object with a weight_map ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFModelError(f"{index}: weight_map must map tensor names to shard file names, "
                           f"not {type(weight_map).__name__}")
    for shard in weight_map.values():
        if not is_plain_name(shard):
            raise HFModelError(f"{index}: shard {shard!r} is not a plain file name inside "
                               f"{index.parent}; an index may only name files beside it")
    return dict(weight_map)


def load_weights(directory: str | Path, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The model's whole tensors under paratrain's names (q/k rows in paratrain's RoPE
    order), for tools and tests; training reads slices (``SafetensorsSlices``)."""
    with SafetensorsSlices(directory, cfg) as source:
        state = {ours: source.read(ours) for ours in [*names(cfg), *stacked_names(cfg)]}
    if cfg.tie_embeddings:  # one tensor under both names, as the built model has it
        state["output.weight"] = state["tok_embeddings.weight"]
    for i in cfg.moe_layers:  # training state transformers does not hold: it starts at zero
        state[f"layers.{i}.mlp.expert_bias"] = torch.zeros(cfg.n_experts)
    return state


class SafetensorsSlices(contextlib.ExitStack):
    """A source of initial values (train/materialize.py) reading a Hugging Face directory
    one box at a time, under paratrain's names: ``fill`` copies exactly a piece's box out of
    the memory-mapped file, so a rank reads only its share of the model."""

    def __init__(self, directory: str | Path, cfg: GPTConfig):
        super().__init__()
        self.root, self.cfg = Path(directory), cfg
        from .hf_check import check_complete  # here: hf_check imports this module

        self.files = weight_files(directory)
        check_complete(directory, cfg, self.files)
        self.theirs = names(cfg)
        self.stacked = stacked_names(cfg)
        self.handles: dict = {}

    def _slice(self, ours: str, theirs: str | None = None):
        from safetensors import safe_open

        theirs = theirs or self.theirs[ours]
        file = self.files[theirs]
        if file not in self.handles:
            self.handles[file] = self.enter_context(safe_open(str(self.root / file), framework="pt"))
        return self.handles[file].get_slice(theirs)

    def read(self, ours: str) -> torch.Tensor:
        """The whole tensor ``ours``."""
        if ours in self.stacked:
            experts = self.stacked[ours]
            shape = (len(experts), *self._slice(ours, experts[0]).get_shape())
        else:
            shape = tuple(self._slice(ours).get_shape())
        return self.box(ours, shape, (0,) * len(shape), shape)

    def box(self, ours: str, shape: tuple[int, ...], offsets: tuple[int, ...],
            extents: tuple[int, ...]) -> torch.Tensor:
        """Box (offsets, extents) of tensor ``ours`` in paratrain's row order. q/k rows are
        permuted within each head, so their rows are read as the span of heads they lie in."""
        cols = tuple(slice(o, o + e) for o, e in zip(offsets[1:], extents[1:]))
        if ours in self.stacked:  # one file tensor per expert: the box's experts, stacked
            experts = self.stacked[ours][offsets[0]:offsets[0] + extents[0]]
            return torch.stack([self._slice(ours, e)[cols] for e in experts])
        view = self._slice(ours)
        rows = _rope_order(ours, shape[0], self.cfg)
        if rows is None:
            return view[(slice(offsets[0], offsets[0] + extents[0]), *cols)]
        wanted = rows[offsets[0]:offsets[0] + extents[0]]
        lo, hi = int(wanted.min()), int(wanted.max()) + 1
        return view[(slice(lo, hi), *cols)][wanted - lo]

    def fill(self, piece) -> None:
        ours = piece.key.removeprefix("param/")
        if ours.endswith("expert_bias"):  # selection bias: state of training, starts at zero
            piece.local.zero_()
            return
        piece.local.copy_(self.box(ours, piece.shape, piece.offsets, piece.extents))


def _rope_order(name: str, rows: int, cfg: GPTConfig) -> torch.Tensor | None:
    """For q/k weights, biases and norms: transformers' row of each of paratrain's rows."""
    if "_norm." in name and ".attn." in name:
        return _rope_rows(cfg.head_dim, 1, True)
    if ".wq." in name or ".wk." in name:
        return _rope_rows(cfg.head_dim, rows // cfg.head_dim, True)
    return None


def check_export_target(out: str | Path, overwrite: bool = False) -> Path:
    """Raise HFModelError, naming --out, if ``out`` is a file or a non-empty directory
    (unless ``overwrite``): an export must not silently replace another model's files. Call
    it before loading the weights, so the refusal comes before any work."""
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise HFModelError(f"--out {out}: exists and is not a directory; choose a new directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise HFModelError(f"--out {out}: the directory exists and is not empty; choose a new "
                           f"one, or pass --overwrite to replace its config.json and model.safetensors")
    if (target / INDEX).is_file():  # the shards --overwrite removes: checked before any work
        read_weight_map(target / INDEX)
    return target


def export(params: dict[str, torch.Tensor], cfg: GPTConfig, out: str | Path,
           dtype: torch.dtype | None = None, overwrite: bool = False,
           extra: dict | None = None) -> Path:
    """Write ``config.json`` (with ``extra`` fields, e.g. special-token ids) +
    ``model.safetensors`` that transformers loads into ``out``, a new or empty directory
    (``overwrite``: any directory, replacing those two files and removing a sharded model's
    index and shards)."""
    from safetensors.torch import save_file

    target = check_export_target(out, overwrite)
    target.mkdir(parents=True, exist_ok=True)
    _remove_shards(target)
    hf_moe.family(cfg)  # a model transformers has no class for is refused before writing
    tensors = {theirs: _permute_rope(ours, params[ours], cfg, False).to(dtype or params[ours].dtype).contiguous()
               for ours, theirs in names(cfg).items()}
    for ours, experts in stacked_names(cfg).items():
        tensors.update({theirs: params[ours][e].to(dtype or params[ours].dtype).contiguous()
                        for e, theirs in enumerate(experts)})
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    stored = next(iter(tensors.values())).dtype
    (target / "config.json").write_text(json.dumps({**hf_config(cfg, stored), **(extra or {})}, indent=2))
    return target


def _remove_shards(target: Path) -> None:
    """Remove a sharded model that ``export --overwrite`` replaces: its index and the shards
    it lists. Left beside the new model.safetensors, they would give any reader of the index
    the old weights."""
    index = target / INDEX
    if index.is_file():
        for shard in set(read_weight_map(index).values()) - {"model.safetensors"}:
            (target / shard).unlink(missing_ok=True)
        index.unlink()


def hf_config(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json transformers reads for ``cfg``, whose tensors are stored in ``dtype``."""
    arch = hf_moe.family(cfg)
    rope: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        _, factor, low, high, original = cfg.rope_scaling.split(":")
        rope = {"rope_theta": cfg.rope_theta, "rope_type": "llama3", "factor": float(factor),
                "low_freq_factor": float(low), "high_freq_factor": float(high),
                "original_max_position_embeddings": int(original)}
    raw = {"architectures": [arch], "model_type": {v: k for k, v in TRAINED.items()}[arch],
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
           "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
           "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
           "hidden_act": "silu", "rope_parameters": rope, "rope_theta": cfg.rope_theta,
           "torch_dtype": str(dtype).removeprefix("torch.")}
    if cfg.rope_scaling:
        raw["rope_scaling"] = rope
    if arch == "MistralForCausalLM":
        raw["sliding_window"] = cfg.sliding_window
    raw.update(hf_moe.config_fields(cfg, arch))
    if arch == "Qwen2ForCausalLM":  # one window for every layer (max_window_layers 0)
        kind = "sliding_attention" if cfg.sliding_window else "full_attention"
        raw.update(use_sliding_window=bool(cfg.sliding_window), sliding_window=cfg.sliding_window or None,
                   max_window_layers=0, layer_types=[kind] * cfg.n_layers)
    return raw
