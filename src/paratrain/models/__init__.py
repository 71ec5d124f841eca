"""Plain models (GPT, a U-Net), their descriptions, and Hugging Face import/export."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping


DEFAULT_PRESET = "small"
"""The preset a model starts from when none is named and no whole shape is given."""
CUSTOM = "custom"
"""The preset of a model given whole by its fields: ``GPTConfig``'s own defaults (one
key/value head per query head, the derived MLP width)."""
WHOLE_SHAPE = ("n_layers", "d_model", "n_heads")
"""Fields that, given together, make a shape of their own."""


def shape_base(fields: Mapping[str, object], named: str | None) -> str:
    """The preset a ``[model]`` table (or the model flags) starts from: the one named; else,
    where the fields give a whole shape, ``CUSTOM``, so that nothing of the default preset
    (its 2 key/value heads, its MLP width) slips into a shape the user wrote out; else the
    default preset, whose fields the given ones change. Train and plan both read it."""
    if named is not None:
        return named
    return CUSTOM if all(k in fields for k in WHOLE_SHAPE) else DEFAULT_PRESET


def has_weights(directory: str | Path) -> bool:
    """Whether a Hugging Face model directory holds the weights ``paratrain train --model
    DIR`` loads (models/hf.py reads these files; this check imports no torch)."""
    return any((Path(directory) / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json"))


def param_shapes(model_cfg, trainable_only: bool = False) -> dict[str, tuple[int, ...]]:
    """Every parameter of the plain model ``model_cfg`` describes (a GPT, or the U-Net), and
    its shape (``trainable_only``: those the optimizer updates, not an MoE's selection
    bias): the model is built on the meta device, so no memory is used."""
    import torch

    from .gpt import GPT, GPTConfig
    from .unet import UNet

    with torch.device("meta"):
        model = GPT(model_cfg) if isinstance(model_cfg, GPTConfig) else UNet(model_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()
            if p.requires_grad or not trainable_only}
