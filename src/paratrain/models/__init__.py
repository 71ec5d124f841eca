"""Plain models (GPT, the heat2d U-Net), their descriptions, and Hugging Face import/export."""

from __future__ import annotations

from pathlib import Path


def has_weights(directory: str | Path) -> bool:
    """Whether a Hugging Face model directory holds the weights ``paratrain train --model
    DIR`` loads (models/hf.py reads these files; this check imports no torch)."""
    return any((Path(directory) / name).is_file()
               for name in ("model.safetensors", "model.safetensors.index.json"))


def param_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter of the plain model ``model_cfg`` describes (a GPT, or the U-Net), and
    its shape: the model is built on the meta device, so no memory is used."""
    import torch

    from .gpt import GPT, GPTConfig
    from .unet import UNet

    with torch.device("meta"):
        model = GPT(model_cfg) if isinstance(model_cfg, GPTConfig) else UNet(model_cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
