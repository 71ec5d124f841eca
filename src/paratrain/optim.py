"""AdamW, the learning-rate schedule and gradient clipping that is correct across ranks.

``cfg`` arguments are ``train.config.OptimConfig`` (any object with its fields).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .comm import collectives as C

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's per-parameter state, as checkpoints store it."""


def build_adamw(params: list[nn.Parameter], cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights are not decayed). On CUDA
    torch's fused kernel, which the foreach default is slower than (measured: docs/gpu.md).
    Elsewhere the foreach default, which the parity tests' peers use too."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = bool(params) and fused_on(params[0].device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None)


def fused_on(device: torch.device) -> bool:
    """Whether ``build_adamw`` asks for torch's fused AdamW on ``device``: on CUDA only
    (measured faster there; on CPU the foreach default matches the parity tests' peers)."""
    return device.type == "cuda"


def adam_step_count(optimizer: torch.optim.Optimizer, step: int,
                    device: torch.device) -> torch.Tensor:
    """Adam's step count as torch's AdamW keeps it, for a resumed state: on the
    parameter's device under the fused kernel (it refuses a CPU count), else on the CPU."""
    fused = bool(optimizer.defaults.get("fused"))
    return torch.tensor(float(step), device=device if fused else "cpu")


def lr_at(step: int, total_steps: int, cfg) -> float:
    """Linear warm-up to ``cfg.lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float,
                    groups: tuple[ProcessGroup, ...] = (),
                    scale: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (0: only measure it).

    ``grads`` are the gradients this rank owns; ``groups`` are the process groups across
    which ownership is partitioned (e.g. the ZeRO shards, the pipeline stages, the tensor-
    parallel shards). The squared norm is summed over those groups, so every rank computes
    the same global norm. A gradient replicated on several ranks must be passed by exactly
    one of them, or by all of them with no group over that axis. The clipping factor is
    applied to ``scale`` (default: ``grads``), which lets a rank clip gradients it does not
    count. Returns the norm before clipping, on the device (reading it syncs the host).
    """
    grads = [g.detach() for g in grads if g is not None]
    scale = grads if scale is None else [g for g in scale if g is not None]
    return clip_by_squared_norm_(squared_norm(grads), max_norm, groups, scale)


@torch.no_grad()
def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of ``tensors``, in fp32 whatever their dtype. One
    multi-tensor kernel per dtype on a GPU (``torch._foreach_norm``), where a power, a sum
    and a full-size temporary per tensor cost 183 launches and 3 passes over the
    gradients of an 837M model (docs/gpu.md)."""
    if not tensors:
        return torch.zeros(())
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).pow(2).sum()


@torch.no_grad()
def clip_by_squared_norm_(sq: torch.Tensor, max_norm: float, groups: tuple[ProcessGroup, ...],
                          tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum this rank's squared norm ``sq`` over ``groups`` and scale ``tensors`` so the
    global norm is at most ``max_norm`` (0: only measure). Returns the global norm."""
    for group in groups:
        C.all_reduce(sq, group)
    norm = sq.sqrt()
    if max_norm > 0 and tensors:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(tensors, coef.to(tensors[0].dtype))
    return norm
