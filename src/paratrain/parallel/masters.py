"""fp32 master weights for a replicated engine whose parameters are bf16 (``--precision
bf16-params``): the model computes with bf16 weights, and AdamW steps fp32 copies of them.

The flow of one step: backward leaves bf16 gradients in DDP's buckets (averaged in bf16,
as ZeRO reduce-scatters its bf16 units); ``bind_grads`` hands the optimizer fp32 copies
of them; AdamW updates the masters and its fp32 moments; ``write_back`` rounds the
masters into the bf16 parameters the next forward uses and drops the fp32 gradient
copies. An update smaller than a bf16 weight's last bit accumulates in the master
instead of being lost, which is what the masters are for.

ZeRO keeps its masters per shard in ``zero/optim.py``; checkpoints save the masters in
both cases (``train/slices.py``), so a resumed run is the uninterrupted one bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    """fp32 copies of ``params`` (the same objects the model computes with), keyed by them."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.masters = {p: p.detach().float().clone() for p in params}

    def of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: its master."""
        return self.masters[param]

    def tensors(self) -> list[torch.Tensor]:
        """The masters, in the parameters' order."""
        return [self.masters[p] for p in self.params]

    @torch.no_grad()
    def bind_grads(self) -> None:
        """The parameters' (averaged) gradients, in fp32, as the masters' gradients."""
        for p, master in self.masters.items():
            master.grad = p.grad.float() if p.grad is not None else None

    @torch.no_grad()
    def write_back(self) -> None:
        """Round the masters into the parameters (one multi-tensor copy on a GPU); free
        the fp32 gradient copies."""
        torch._foreach_copy_(self.params, self.tensors())
        for master in self.masters.values():
            master.grad = None


def cast_params(module: nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter of ``module`` ``dtype``, keeping the
    ``Parameter`` objects (tensor parallelism, tied ends and hooks key them). Buffers keep
    theirs: the rotary tables stay fp32."""
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
