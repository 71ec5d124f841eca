"""Turn a plain model into a parallel one, in a fixed order.

The order every strategy composes in:
TP/SP -> CP -> pipeline split -> activation checkpointing -> ZeRO/DDP wrapping.
Strategies not implemented yet are rejected up front by ``Config.validate``.
"""

from __future__ import annotations

import torch
from torch import nn

from .mesh import Mesh
from .parallel.context import apply_context_parallel
from .parallel.data import DataParallel
from .parallel.engine import ReplicatedEngine
from .parallel.recompute import apply_recompute
from .parallel.tensor import apply_tensor_parallel
from .parallel.zero import ZeroDataParallel
from .train.config import Config


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> nn.Module:
    """Wrap ``model`` (already on ``mesh.device``) for the layout in ``cfg``; returns an
    engine (see parallel/engine.py) that owns the optimizer too.

    Gradients are averaged over dp x cp: context-parallel ranks hold the same weights but
    see different tokens, exactly like data-parallel replicas.
    """
    tp = None
    if cfg.parallel.tp > 1:
        tp = apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=cfg.parallel.sp)
    if cfg.parallel.cp > 1:
        apply_context_parallel(model, mesh.group("cp"), cfg.parallel.cp_method)
    apply_recompute(model.layers, cfg.train.recompute)
    group = mesh.group("dp-cp")
    if cfg.parallel.zero:
        dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
        return ZeroDataParallel(model, group, cfg.parallel.zero, cfg.optim,
                                param_dtype=dtype, offload=cfg.parallel.offload, tp=tp)
    return ReplicatedEngine(DataParallel(model, group, bucket_mb=cfg.parallel.bucket_mb), cfg.optim, tp)
