"""A Hugging Face ``config.json`` read as a ``ModelSpec``: the shape under each family's
key names, and a refusal, naming the field, for what the planner would misread (mixtures
of experts, encoder-decoders, a head_dim other than hidden / heads, values of the wrong
type)."""

from __future__ import annotations

import json
from pathlib import Path

from ..models import has_weights
from .models import ModelSpec, check_values

_HF_ALIASES = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "d_model": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}
_HF_OPTIONAL = {
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "max_seq_len": ("max_position_embeddings", "n_positions", "seq_length", "n_ctx"),
}
_GPT_LIKE = {"gpt2", "gpt_neox", "bloom", "gpt_bigcode", "opt", "gptj"}
_TRAINED = {"llama", "mistral", "qwen2"}
"""model_type values whose directory ``paratrain train --model DIR`` loads (models/hf.py)."""
_TIED_BY_DEFAULT = {"gpt2", "bloom", "gpt_bigcode", "opt"}
_GATED = {"gemma", "gemma2", "gemma3", "gemma3_text"}
"""Gated MLPs (GeGLU) whose activation is a GELU, which alone would read as an ungated MLP."""
MAX_LAYERS = 10_000
"""A sanity bound: the planner's per-stage tables grow with the layer count."""
_DROPOUT_KEYS = ("attn_pdrop", "resid_pdrop", "attention_dropout", "hidden_dropout")


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen, GPT-2, GPT-NeoX, BLOOM)."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object of model settings")
    refuse_unmodelled(cfg, path)
    _check_hf_types(cfg, path)
    values, keys_used = {}, {}
    for field, keys in {**_HF_ALIASES, **_HF_OPTIONAL}.items():
        key = next((k for k in keys if cfg.get(k) is not None), None)
        if key is None and field in _HF_ALIASES:
            raise ValueError(f"{path}: no {field} (looked for {', '.join(keys)})")
        if key is not None:
            values[field], keys_used[field] = cfg[key], key
    check_values(path, values, keys_used)
    if values["n_layers"] > MAX_LAYERS:
        raise ValueError(f"{path}: {keys_used['n_layers']} = {values['n_layers']}: more than "
                         f"{MAX_LAYERS:,} layers, beyond any trained transformer; check the file")
    _check_head_dim(cfg, values, keys_used, path)
    kind = str(cfg.get("model_type", "llama"))
    gpt_like = kind in _GPT_LIKE
    values.setdefault("n_kv_heads", values["n_heads"])
    values.setdefault("ffn_hidden", 4 * values["d_model"])
    values.setdefault("max_seq_len", 2048)
    window = cfg.get("sliding_window") if (kind == "mistral" or cfg.get("use_sliding_window")) else None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        values["max_seq_len"] = min(values["max_seq_len"], window)  # paratrain trains within it
    act = str(cfg.get("hidden_act", cfg.get("activation_function", "")))
    return ModelSpec(
        name=f"{path.parent.name or path.name} ({kind})", **values,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", kind in _TIED_BY_DEFAULT)),
        gated_mlp=kind in _GATED or (not gpt_like and act in ("silu", "swish", "swiglu", "")),
        bias=gpt_like or bool(cfg.get("attention_bias", False)),
        norm="layernorm" if gpt_like else "rmsnorm",
        learned_pos=kind in ("gpt2", "gpt_bigcode", "opt"),
        dropout=any(float(cfg.get(k) or 0) > 0 for k in _DROPOUT_KEYS),
        qkv_bias=kind == "qwen2",  # Qwen2 biases q, k and v only, without a config key
        # --out: the directory as train's preset (absolute: any cwd) only where train can
        # load its weights; a config.json alone (examples/llama3-8b) becomes its shape, which
        # train builds with random weights, as it builds --model llama3-8b.
        preset=str(path.parent.resolve()) if kind in _TRAINED and has_weights(path.parent) else "",
        carried=_carried(cfg) if kind in _TRAINED else (),
    )


def _carried(cfg: dict) -> tuple[tuple[str, object], ...]:
    """The Llama-family values besides the shape that a train config takes (GPTConfig
    fields), so that a config written from a weightless config.json keeps its rotary base
    and norm epsilon."""
    rope = cfg.get("rope_parameters")  # transformers 5 keeps rope_theta there
    theta = cfg.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    pairs = (("rope_theta", theta), ("norm_eps", cfg.get("rms_norm_eps")))
    return tuple((k, float(v)) for k, v in pairs
                 if type(v) in (int, float) and v > 0)


def _check_hf_types(cfg: dict, path: Path) -> None:
    """The fields read besides the shape: a string "false" is not false, a list no rate."""
    tied = cfg.get("tie_word_embeddings")
    if tied is not None and type(tied) is not bool:
        raise ValueError(f"{path}: tie_word_embeddings must be true or false, got {json.dumps(tied)}")
    for key in _DROPOUT_KEYS:
        rate = cfg.get(key)
        if rate is not None and (type(rate) not in (int, float) or not 0 <= rate < 1):
            raise ValueError(f"{path}: {key} must be a number in [0, 1), got {json.dumps(rate)}")


def _check_head_dim(cfg: dict, values: dict, keys: dict, path: Path) -> None:
    """A head_dim other than hidden / heads (Mistral-Nemo, Gemma, Qwen3-4B) changes every
    attention width the planner derives from hidden / heads: refused, not misread."""
    head_dim = cfg.get("head_dim")
    if values["d_model"] % values["n_heads"]:
        raise ValueError(f"{path}: {keys['d_model']} = {values['d_model']} is not divisible by "
                         f"{keys['n_heads']} = {values['n_heads']}")
    derived = values["d_model"] // values["n_heads"]
    if head_dim is not None and head_dim != derived:
        raise ValueError(f"{path}: head_dim = {json.dumps(head_dim)} differs from "
                         f"{keys['d_model']} / {keys['n_heads']} = {derived}, which the planner "
                         f"(and paratrain train) assume; such models are not modelled yet")


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                "num_experts_per_tok")
_ENCODER_DECODER = {"t5", "mt5", "umt5", "longt5", "switch_transformers", "bart", "mbart",
                    "pegasus", "marian", "whisper", "encoder-decoder"}


def refuse_unmodelled(cfg: dict, path: Path) -> None:
    """Raise ValueError, naming the model, for architectures the planner would misread as
    a dense decoder: mixtures of experts (their parameters, memory and FLOPs depend on
    the experts and expert parallelism) and encoder-decoders (two stacks, cross
    attention)."""
    kind = str(cfg.get("model_type", "?"))
    # a config.json is named by its model's directory; any other file by its own path
    shown = path.parent.name if path.name == "config.json" and path.parent.name else str(path)
    name = f"{shown} (model_type {kind!r})"
    experts = {k: cfg[k] for k in _EXPERT_KEYS[:-1]
               if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool) and cfg[k] > 1}
    if experts:
        key, count = next(iter(experts.items()))
        raise ValueError(f"{name} is a mixture of experts ({key} = {count}): the planner "
                         f"models dense decoder-only transformers only and would plan it as "
                         f"a dense model of the same width; MoE is not supported yet")
    if cfg.get("is_encoder_decoder") is True or kind in _ENCODER_DECODER:
        raise ValueError(f"{name} is an encoder-decoder model: the planner models "
                         f"decoder-only transformers only and would plan it as a decoder; "
                         f"encoder-decoder models are not supported")
