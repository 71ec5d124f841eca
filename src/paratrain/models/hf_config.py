"""The one reader of a Hugging Face ``config.json``: ``train --model DIR`` (``models/hf.py``)
and ``plan --model`` (``plan/models.py``) both read a model's shape through it.

``load`` gives the JSON object; ``read_shape`` its ``ModelShape`` under each family's key
names (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, BLOOM, ...), every value checked for its
kind and the head width refused where it is not hidden / heads. The trainer then asks
``trainable`` (the Llama family paratrain's GPT loads: architecture, activation, biases,
rotary scaling, attention window); the planner asks ``refuse_unmodelled`` (mixtures of
experts, encoder-decoders). Torch-free: the planner runs without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from .shape import ModelShape


class HFModelError(ValueError):
    """A model directory or config.json paratrain cannot read or train; the message says
    why and what is supported."""


_REQUIRED = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "d_model": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size",),
}
_OPTIONAL = {
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "max_seq_len": ("max_position_embeddings", "n_positions", "seq_length", "n_ctx"),
}
_GPT_LIKE = {"gpt2", "gpt_neox", "bloom", "gpt_bigcode", "opt", "gptj"}
_TIED_BY_DEFAULT = {"gpt2", "bloom", "gpt_bigcode", "opt"}
_GATED = {"gemma", "gemma2", "gemma3", "gemma3_text"}
"""Gated MLPs (GeGLU) whose activation is a GELU, which alone would read as an ungated MLP."""
_DROPOUT_KEYS = ("attn_pdrop", "resid_pdrop", "attention_dropout", "hidden_dropout")
MAX_LAYERS = 10_000
"""A sanity bound: the planner's per-stage tables grow with the layer count."""
_INTS = (*(k for keys in {**_REQUIRED, **_OPTIONAL}.values() for k in keys), "head_dim")
_FLOATS = ("rope_theta", "rms_norm_eps")
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The fields of Llama-3's rope scaling."""


def load(path: str | Path) -> dict:
    """The JSON object of a config.json; HFModelError naming the file otherwise."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise HFModelError(f"{path}: unreadable ({exc})") from None
    except json.JSONDecodeError as exc:
        raise HFModelError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HFModelError(f"{path}: expected a JSON object of model settings, got "
                           f"{type(raw).__name__}")
    return raw


def model_type(raw: dict) -> str:
    return str(raw.get("model_type", "llama"))


def rope_parameters(raw: dict) -> dict:
    """The rotary settings: transformers 5's ``rope_parameters``, or 4's ``rope_theta`` and
    ``rope_scaling``."""
    return raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0),
                                          **(raw.get("rope_scaling") or {})}


def read_shape(raw: dict, path: str | Path, any_head_dim: bool = False) -> ModelShape:
    """The shape a config.json describes, each value checked for its kind. ``any_head_dim``
    (the planner): a head_dim other than hidden / heads becomes ``explicit_head_dim``
    instead of an error."""
    path = Path(path)
    check_types(raw, path)
    values, keys = {}, {}
    for name, aliases in {**_REQUIRED, **_OPTIONAL}.items():
        key = next((k for k in aliases if raw.get(k) is not None), None)
        if key is None and name in _REQUIRED:
            raise HFModelError(f"{path}: no {name} (looked for {', '.join(aliases)})")
        if key is not None:
            values[name], keys[name] = raw[key], key
    if values["n_layers"] > MAX_LAYERS:
        raise HFModelError(f"{path}: {keys['n_layers']} = {values['n_layers']}: more than "
                           f"{MAX_LAYERS:,} layers, beyond any trained transformer; check the file")
    head_dim = _check_head_dim(raw, values, keys, path, any_head_dim)
    kind = model_type(raw)
    gpt_like = kind in _GPT_LIKE
    act = str(raw.get("hidden_act", raw.get("activation_function", "")))
    try:
        return ModelShape(
            n_layers=values["n_layers"], d_model=values["d_model"], n_heads=values["n_heads"],
            n_kv_heads=values.get("n_kv_heads", values["n_heads"]),
            ffn_hidden=values.get("ffn_hidden", 4 * values["d_model"]),
            vocab_size=values["vocab_size"], max_seq_len=values.get("max_seq_len", 2048),
            tie_embeddings=bool(raw.get("tie_word_embeddings", kind in _TIED_BY_DEFAULT)),
            gated_mlp=kind in _GATED or (not gpt_like and act in ("silu", "swish", "swiglu", "")),
            bias=gpt_like or bool(raw.get("attention_bias", False)),
            norm="layernorm" if gpt_like else "rmsnorm", learned_pos=kind in ("gpt2", "gpt_bigcode", "opt"),
            dropout=any(float(raw.get(k) or 0) > 0 for k in _DROPOUT_KEYS),
            # Qwen2 biases q, k and v only, without a config key (Qwen2-MoE says qkv_bias)
            qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and raw.get("qkv_bias", True) is not False),
            explicit_head_dim=head_dim)
    except ValueError as exc:  # the shape's own checks, in its own field names
        raise HFModelError(f"{path.parent if path.name == 'config.json' else path}: config.json "
                           f"describes a shape paratrain cannot build: {exc} (d_model is "
                           f"hidden_size, n_heads num_attention_heads, n_kv_heads "
                           f"num_key_value_heads)") from None


def check_types(raw: dict, path: Path) -> None:
    """A value of the wrong kind (``"hidden_size": "64"``, a string "false", a list as a
    rate) is named with its key; it would otherwise surface as Python's own TypeError."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise HFModelError(f"{path}: {key} must be a JSON object (or null), got "
                               f"{json.dumps(raw[key])}; correct it in config.json")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    checks = [(k, raw.get(k), int) for k in _INTS] + [(k, raw.get(k), float) for k in _FLOATS]
    checks += [(f"rope_parameters.{k}", rope.get(k), float) for k in ("rope_theta", *LLAMA3_ROPE)]
    for key, value, kind in checks:
        if value is None:
            continue  # absent (or null): transformers' default applies
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or value <= 0:
            want = "a positive integer" if kind is int else "a positive number"
            raise HFModelError(f"{path}: {key} must be {want}, got {json.dumps(value)}; "
                               f"correct it in config.json")
    tied = raw.get("tie_word_embeddings")
    if tied is not None and type(tied) is not bool:
        raise HFModelError(f"{path}: tie_word_embeddings must be true or false, got {json.dumps(tied)}")
    for key in _DROPOUT_KEYS:
        rate = raw.get(key)
        if rate is not None and (type(rate) not in (int, float) or not 0 <= rate < 1):
            raise HFModelError(f"{path}: {key} must be a number in [0, 1), got {json.dumps(rate)}")


def _check_head_dim(raw: dict, values: dict, keys: dict, path: Path, allowed: bool) -> int:
    """A head_dim other than hidden / heads (Mistral-Nemo, Gemma, Qwen3-4B, Qwen3-MoE)
    changes every attention width derived from hidden / heads: refused, not misread, unless
    ``allowed`` (then returned, for ``explicit_head_dim``; 0 when it is hidden / heads)."""
    head_dim = raw.get("head_dim")
    derived = values["d_model"] // values["n_heads"]
    if allowed and isinstance(head_dim, int) and head_dim > 0:
        return 0 if head_dim == derived and not values["d_model"] % values["n_heads"] else head_dim
    if values["d_model"] % values["n_heads"]:
        raise HFModelError(f"{path}: {keys['d_model']} = {values['d_model']} is not divisible by "
                           f"{keys['n_heads']} = {values['n_heads']}")
    if head_dim is not None and head_dim != derived:
        raise HFModelError(f"{path}: head_dim = {json.dumps(head_dim)} differs from "
                           f"{keys['d_model']} / {keys['n_heads']} = {derived}, which paratrain's "
                           f"GPT assumes; `paratrain plan` models it, `train` cannot build it")
    return 0


# ---- what the trainer loads ----------------------------------------------------------------

TRAINED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
"""model_type -> the architecture ``paratrain train --model DIR`` loads into its GPT
(mixtures of experts through models/hf_moe.py)."""
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""config.json fields a trained model's shape needs (the others have transformers' defaults)."""


def architecture(raw: dict) -> str:
    archs = raw.get("architectures") or [TRAINED.get(raw.get("model_type", ""), raw.get("model_type", "?"))]
    return archs[0]


def trainable(raw: dict, path: Path) -> None:
    """Raise HFModelError unless paratrain's GPT is this model: a Llama-family decoder
    (dense, or a mixture of SwiGLU experts) with no MLP or output biases."""
    directory, arch = path.parent, architecture(raw)
    if arch not in TRAINED.values():
        raise HFModelError(f"{directory}: architecture {arch} is not supported; paratrain trains "
                           f"{', '.join(TRAINED.values())}. Other mixtures of experts (DeepSeek's "
                           f"latent attention), encoder-decoders and other families are refused")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise HFModelError(f"{path}: {', '.join(missing)} missing; a {arch} config.json gives "
                           f"{', '.join(REQUIRED)}")
    check_types(raw, path)
    if raw.get("mlp_bias"):
        raise HFModelError(f"{directory}: mlp_bias=true is not supported (no MLP biases)")
    if arch == "LlamaForCausalLM" and raw.get("attention_bias"):
        raise HFModelError(f"{directory}: attention_bias=true puts a bias on the output "
                           f"projection, which paratrain's row-parallel layer does not carry")
    if raw.get("hidden_act", "silu") != "silu":
        raise HFModelError(f"{directory}: hidden_act={raw['hidden_act']!r}; only silu (SwiGLU)")


def rope_scaling(raw: dict, directory: Path) -> str:
    """``GPTConfig.rope_scaling`` of a config.json: '' or llama3's four numbers."""
    rope = rope_parameters(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ""
    if kind != "llama3":
        raise HFModelError(f"{directory}: rope_type {kind!r} is not supported (default or llama3)")
    missing = [k for k in LLAMA3_ROPE if k not in rope]
    if missing:
        raise HFModelError(f"{directory}: rope_type llama3 needs {', '.join(LLAMA3_ROPE)} in "
                           f"rope_scaling (or rope_parameters); {', '.join(missing)} missing")
    return (f"llama3:{rope['factor']}:{rope['low_freq_factor']}:{rope['high_freq_factor']}:"
            f"{rope['original_max_position_embeddings']}")


def sliding_window(raw: dict, directory: Path) -> int:
    """The attention window of every layer (0: none). Qwen2 slides only with
    use_sliding_window, and then from layer max_window_layers on (its ``layer_types``);
    paratrain gives every layer the same attention, so a mix is refused."""
    window = int(raw.get("sliding_window") or 0)
    if architecture(raw) != "Qwen2ForCausalLM":
        return window
    first = raw.get("max_window_layers", 28) if raw.get("use_sliding_window") else raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                       for i in range(raw["num_hidden_layers"])]
    kinds = set(types)
    if kinds == {"full_attention"} or not window:
        return 0
    if kinds == {"sliding_attention"}:
        return window
    raise HFModelError(f"{directory}: Qwen2 slides its attention window on some layers only "
                       f"(use_sliding_window with max_window_layers={first}); paratrain gives "
                       f"every layer the same attention: set max_window_layers to 0 (every "
                       f"layer slides) or use_sliding_window to false")


# ---- what the planner refuses -------------------------------------------------------------

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
MOE_PLANNED = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixtures of experts the planner reads (``plan/hf_config.py``, through ``models/hf_moe.py``
as train does): the ones train runs; any other is refused by name."""
_ENCODER_DECODER = {"t5", "mt5", "umt5", "longt5", "switch_transformers", "bart", "mbart",
                    "pegasus", "marian", "whisper", "encoder-decoder"}


def refuse_unmodelled(raw: dict, path: Path) -> None:
    """Raise HFModelError, naming the model, for architectures the planner would misread
    as a dense decoder: mixtures of experts other than ``MOE_PLANNED`` (DeepSeek's, ...) and
    encoder-decoders (two stacks, cross attention)."""
    kind = str(raw.get("model_type", "?"))
    # a config.json is named by its model's directory; any other file by its own path
    shown = path.parent.name if path.name == "config.json" and path.parent.name else str(path)
    name = f"{shown} (model_type {kind!r})"
    experts = {k: raw[k] for k in _EXPERT_KEYS
               if isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool) and raw[k] > 1}
    if experts and kind not in MOE_PLANNED:
        key, count = next(iter(experts.items()))
        raise HFModelError(f"{name} is a mixture of experts ({key} = {count}) the planner does "
                           f"not model (it would plan it as a dense model of the same width); "
                           f"it plans the ones `paratrain train` runs: "
                           f"{', '.join(TRAINED[k] for k in MOE_PLANNED)} (docs/moe.md)")
    if raw.get("is_encoder_decoder") is True or kind in _ENCODER_DECODER:
        raise HFModelError(f"{name} is an encoder-decoder model: the planner models "
                           f"decoder-only transformers only and would plan it as a decoder; "
                           f"encoder-decoder models are not supported")
