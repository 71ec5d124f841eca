"""paratrain from Python, for users who keep their own training loop.

The pieces ``paratrain train`` is built from, in the order a loop uses them::

    from paratrain import api

    cfg = api.config(model="path/to/llama_dir", tp=2, dp=2, seq_len=512,
                     global_batch=32, micro_batch=4, lr=3e-4)      # checked, resolved
    mesh = api.mesh(cfg)                       # after the world is joined (torchrun or spawn)
    engine = api.parallelize(api.build_model(cfg, mesh.device, meta=True), mesh, cfg)
    for step in range(steps):
        engine.zero_grad()
        loss = engine.forward_backward(microbatches, loss_scale=1 / tokens_in_global_batch)
        norm = engine.clip_grad_norm_(1.0)
        engine.step(api.lr_at(step, cfg))
    weights = engine.full_state_dict()         # unsharded, under the plain model's names

``microbatches`` are this data-parallel rank's (tokens, targets) pairs; the engine shards
them further for context parallelism and runs them through its pipeline schedule.
Data parallelism and ZeRO wrap any module whose ``forward(tokens, targets,
positions=None)`` returns the summed token loss; tensor, sequence, context and pipeline
parallelism also need the module's ``description()`` (``ModelDescription``,
docs/models.md). ``examples/train_llama.py`` trains a Hugging Face Llama this way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .launch import spawn
from .layout import Layout
from .mesh import Mesh
from .models import hf
from .models.description import ModelDescription
from .models.gpt import GPT
from .optim import lr_at as _lr_at
from .parallel.engine import Engine
from .parallelize import parallelize as _parallelize
from .train.config import Config, ConfigError, load
from .train.materialize import fill, has_meta, initial_source

__all__ = ["Config", "ConfigError", "Engine", "Layout", "Mesh", "ModelDescription", "build_model",
           "config", "lr_at", "mesh", "parallelize", "spawn"]


def config(path: str | None = None, **fields: Any) -> Config:
    """A checked, resolved training config: the defaults, then the TOML file at ``path``,
    then ``fields`` (the flat names ``paratrain train`` takes as flags, e.g. ``tp=2``,
    ``model="tiny"`` or a Hugging Face directory). Raises ``ConfigError`` naming the field."""
    if "model" in fields:  # the flag's name; the config calls it the preset
        fields["preset"] = fields.pop("model")
    return load(path, fields).validate()


def mesh(cfg: Config, device: torch.device | None = None) -> Mesh:
    """This rank's process groups for the config's layout. The world must already be
    joined (torchrun + ``torch.distributed.init_process_group``, or ``spawn``)."""
    return Mesh.build(cfg.layout, device)


def build_model(cfg: Config, device: torch.device | str | None = None, *,
                meta: bool = False) -> nn.Module:
    """paratrain's GPT at the config's shape. ``meta``: without storage (the rotary tables
    on ``device``), for ``parallelize`` to give each rank only its share; otherwise whole,
    with the weights every layout starts from: the Hugging Face directory's when the
    config's model is one, else drawn from ``cfg.train.seed`` (``models.gpt.init_tensor``)."""
    if meta:
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.init_buffers(device or "cpu")
        return model
    model = GPT(cfg.model, seed=cfg.train.seed)
    if hf.is_model_dir(cfg.model_preset):
        model.load_state_dict(hf.load_weights(cfg.model_preset, cfg.model))
    return model.to(device) if device is not None else model


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> Engine:
    """The engine for the config's layout (``paratrain.parallelize.parallelize``); a model
    built with ``meta=True`` gets this rank's share of the initial weights, read or drawn
    piece by piece (train/materialize.py): no rank ever holds the whole model."""
    meta = has_meta(model)
    engine = _parallelize(model, mesh, cfg.parallel_options())
    if meta:
        fill(engine, initial_source(cfg))
    return engine


def lr_at(step: int, cfg: Config) -> float:
    """The learning rate of ``step`` (0-based) under the config's warm-up and decay."""
    return _lr_at(step, cfg.train.steps, cfg.optim)
