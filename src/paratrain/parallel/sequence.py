"""Megatron sequence parallelism (Korthikanti et al. 2022): where a tensor-parallel region
begins and ends.

Plain tensor parallelism leaves the residual stream, the norms and the dropouts replicated:
every rank of the group holds the full (b, s, h) activations there and stores them for
backward. Sequence parallelism shards exactly those parts along the sequence, (b, s/t, h)
per rank, which is possible because they act on each token independently. The all-reduce
at a block's exit is split into its two halves and moved around the block:

    plain TP:  x --f--> [column ... row] --g: all-reduce--> x
    TP + SP:   x_shard --all-gather--> [column ... row] --reduce-scatter--> x_shard

An all-reduce costs one reduce-scatter plus one all-gather, so the communicated volume is
unchanged, while activation memory outside the attention/MLP cores falls by t.

Consequence for gradients: the norm weights are still replicated, but each rank now sees
only its own tokens, so each computes a *partial* gradient; ``TensorParallel.
sync_replicated_grads`` sums them over the group after backward.

Overlap: the backward collective at a region's entry (f's all-reduce, or SP's
reduce-scatter) needs the sum of the input gradients of the column-parallel layers that
read the region's input, and nothing downstream can run before it. Their *weight*
gradients are not needed by it, so ``EnterColumnParallel`` launches the collective first
and computes them while it runs (``DeferredWeightGradLinear`` leaves them to it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import autograd as A


class DeferredWeightGradLinear(torch.autograd.Function):
    """y = x W^T whose weight gradient is computed by the region's entry operator.

    Forward: the matmul. Backward: the input gradient only; (grad_output, input) go to
    ``pending`` so the entry can compute the weight gradient while its collective runs.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, pending: dict, key: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.pending, ctx.key = pending, key
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.pending[ctx.key] = (grad, x)
        return grad @ weight.to(grad.dtype), None, None, None  # bf16 under autocast


class EnterColumnParallel(torch.autograd.Function):
    """Entry of a tensor-parallel region that also owns the weight gradients of the
    column-parallel layers reading its output, so its backward collective overlaps them
    (Megatron's asynchronous tensor-parallel all-reduce).

    Forward: f's identity (plain TP) or the all-gather along the sequence (SP). The output
    carries a dict, ``tp_pending``, in which those layers leave (grad_output, input) in
    backward instead of computing their weight gradient.
    Backward: launch the all-reduce (TP) or reduce-scatter (SP) of the input gradient,
    compute the layers' weight gradients while it is in flight, then wait.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, regions: "Regions", pending: dict, keys: tuple,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.regions, ctx.pending, ctx.keys = regions, pending, keys
        ctx.dtypes = [w.dtype for w in weights]
        if regions.sequence_parallel:  # contiguous (b, s, h): the layers' matmuls read it as is
            return A.gather_seq(x, regions.group).contiguous()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.regions.group
        if ctx.regions.sequence_parallel:
            grad_input, work = A.start_reduce_scatter_seq(grad, group)
        else:
            grad_input, work = A.start_all_reduce(grad, group)
        weight_grads = []
        for key, dtype in zip(ctx.keys, ctx.dtypes):
            deferred, ctx.pending[key] = ctx.pending[key], None
            if deferred is None:  # the layer was not used, or computed its own
                weight_grads.append(None)
                continue
            grad_out, x = deferred
            # in the output's dtype, as autocast's matmul would (bf16 under autocast)
            g, x = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            weight_grads.append((g.t() @ x.to(g.dtype)).to(dtype))
        work.wait()
        return (grad_input, None, None, None, *weight_grads)


class Regions:
    """The operators at the entry and exit of a tensor-parallel region (an attention or
    MLP block, the output projection, the embedding), for plain TP or TP + SP."""

    def __init__(self, group: ProcessGroup, sequence_parallel: bool, overlap: bool = True):
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Before column-parallel layers: f (identity / all-reduce backward), or under SP the
        all-gather along the sequence (reduce-scatter backward)."""
        if self.sequence_parallel:
            return A.gather_from_sequence_region(x, self.group)
        return A.copy_to_tp_region(x, self.group)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """After row-parallel layers (or the vocab-parallel embedding): g (all-reduce /
        identity backward), or under SP the reduce-scatter along the sequence (all-gather
        backward)."""
        if self.sequence_parallel:
            return A.reduce_scatter_to_sequence_region(x, self.group)
        return A.reduce_from_tp_region(x, self.group)

    def enter_overlapped(self, x: torch.Tensor, layers: list[nn.Module]) -> torch.Tensor:
        """``enter``, with the weight gradients of ``layers`` (the column-parallel layers
        reading the result) computed while the backward collective runs."""
        if not self.overlap:
            return self.enter(x)
        keys = tuple(id(layer) for layer in layers)
        pending: dict = dict.fromkeys(keys)  # only these layers defer their weight gradient
        out = EnterColumnParallel.apply(x, self, pending, keys, *(layer.weight for layer in layers))
        out.tp_pending = pending  # per forward call: microbatches in flight do not mix
        return out

    # Module hooks, so the plain model's submodules keep their names (and the state dict
    # its keys): the first positional argument enters, the output exits.
    def enter_hook(self, layers: list[nn.Module]):
        """A forward pre-hook: the module's first argument enters the region read by
        ``layers``."""
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (self.enter_overlapped(args[0], layers), *args[1:])
        return hook

    def exit_hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return self.exit(output)
