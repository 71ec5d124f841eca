"""A Hugging Face ``config.json`` as the planner's ``ModelSpec``: the shape from the one
config.json reader (``models/hf_config.py``, which ``train`` reads too), with what only the
planner needs: the refusal of models it would misread, the attention window as the
longest sequence, and the preset and settings ``plan --out`` writes back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..models import has_weights
from ..models.hf_config import MOE_PLANNED, TRAINED, load, read_shape, refuse_unmodelled
from ..models.hf_moe import read_fields
from .mla import DEEPSEEK, from_deepseek
from .moe import SHAPE_FIELDS
from .models import ModelSpec, of_shape


def from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen, GPT-2, GPT-NeoX, BLOOM, the
    mixtures of experts Mixtral, Qwen2/3-MoE and DeepSeek-V3)."""
    path = Path(path)
    raw = load(path)
    if raw.get("model_type") in DEEPSEEK:  # latent attention: planner-only (plan/mla.py)
        shape, attention = from_deepseek(raw, path)
        name = f"{path.parent.name or path.name} ({raw['model_type']})"
        return of_shape(shape, name, mla=attention)
    refuse_unmodelled(raw, path)
    shape = read_shape(raw, path, any_head_dim=True)
    kind = str(raw.get("model_type", "llama"))
    experts = read_fields(raw, path) if kind in MOE_PLANNED else {}
    if experts:  # the experts as train reads them; the routing values are carried to --out
        shape = replace(shape, **{k: v for k, v in experts.items() if k in SHAPE_FIELDS + ("qk_norm",)})
    window = raw.get("sliding_window") if (kind == "mistral" or raw.get("use_sliding_window")) else None
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        shape = replace(shape, max_seq_len=min(shape.max_seq_len, window))  # paratrain trains within it
    trained = kind in TRAINED
    # --out: the directory as train's preset (absolute: any cwd) only where train can load
    # its weights; a config.json alone (examples/llama3-8b) becomes its shape, which train
    # builds with random weights, as it builds --model llama3-8b.
    return of_shape(shape, f"{path.parent.name or path.name} ({kind})",
                    preset=str(path.parent.resolve()) if trained and has_weights(path.parent) else "",
                    carried=(_carried(raw) + tuple((k, v) for k, v in experts.items()
                                                   if k not in SHAPE_FIELDS + ("qk_norm",)))
                    if trained else ())


def _carried(raw: dict) -> tuple[tuple[str, object], ...]:
    """The Llama-family values besides the shape that a train config takes (GPTConfig
    fields), so that a config written from a weightless config.json keeps its rotary base
    and norm epsilon."""
    rope = raw.get("rope_parameters")  # transformers 5 keeps rope_theta there
    theta = raw.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
    pairs = (("rope_theta", theta), ("norm_eps", raw.get("rms_norm_eps")))
    return tuple((k, float(v)) for k, v in pairs
                 if type(v) in (int, float) and v > 0)
