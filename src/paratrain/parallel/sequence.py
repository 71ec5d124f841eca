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
gradients are not needed by it, so ``EnterColumnParallel``, which computes the entry and
those layers' GEMMs as one Function, launches the collective first and computes the
weight gradients while it runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import autograd as A


class EnterColumnParallel(torch.autograd.Function):
    """Entry of a tensor-parallel region together with the GEMMs of the column-parallel
    layers that read it, so that its backward collective overlaps their weight gradients
    (Megatron's asynchronous tensor-parallel all-reduce) inside one Function.

    Forward: f's identity (plain TP) or the all-gather along the sequence (SP) of ``x``,
    then ``y_i = x W_i^T (+ b_i)`` for each layer. Returns the entered input and the ``y_i``.
    Backward: the input gradient (the sum over the layers, plus any other use of the
    entered input), launch its all-reduce (TP) or reduce-scatter (SP), compute the weights'
    (and biases') gradients while it is in flight, then wait.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, regions: "Regions", n: int, *params) -> tuple:
        weights, biases = params[:n], params[n:]
        ctx.regions, ctx.n = regions, n
        ctx.has_bias = [b is not None for b in biases]
        # contiguous (b, s, h): the layers' matmuls read it as is
        entered = (A.gather_seq(x, regions.group).contiguous() if regions.sequence_parallel
                   else x.view_as(x))
        ctx.save_for_backward(entered, *weights)
        return (entered, *(F.linear(entered, w, b) for w, b in zip(weights, biases)))

    @staticmethod
    def backward(ctx, grad_entered: torch.Tensor | None, *grads: torch.Tensor | None):
        entered, *weights = ctx.saved_tensors
        wants_input, wants_weights = _passes(ctx)
        if not wants_input:  # a zero-bubble W (pipeline/split.py): the weights' GEMMs only
            return (None, None, None, *_weight_grads(entered, grads, weights, ctx.has_bias))
        group = ctx.regions.group
        used = [(g, w) for g, w in zip(grads, weights) if g is not None]
        grad_input = grad_entered
        for g, w in used:  # bf16 under autocast: in the output's dtype, as autocast would
            term = g @ w.to(g.dtype)
            grad_input = term if grad_input is None else grad_input + term
        if grad_input is None:
            grad_input = torch.zeros_like(entered)
        if ctx.regions.sequence_parallel:
            grad_input, work = A.start_reduce_scatter_seq(grad_input, group)
        else:
            grad_input, work = A.start_all_reduce(grad_input, group)
        # While the collective is in flight; a zero-bubble B leaves them to its W.
        params = (_weight_grads(entered, grads, weights, ctx.has_bias) if wants_weights
                  else [None] * 2 * len(weights))
        work.wait()
        return (grad_input, None, None, *params)


def _weight_grads(entered: torch.Tensor, grads: tuple, weights: list,
                  has_bias: list[bool]) -> list[torch.Tensor | None]:
    """The layers' weight gradients, then their bias gradients (None where unused)."""
    weight_grads, bias_grads = [], []
    for g, w, bias in zip(grads, weights, has_bias):
        if g is None:
            weight_grads.append(None)
            bias_grads.append(None)
            continue
        flat_g, flat_x = g.reshape(-1, g.shape[-1]), entered.reshape(-1, entered.shape[-1])
        weight_grads.append((flat_g.t() @ flat_x.to(g.dtype)).to(w.dtype))
        bias_grads.append(flat_g.sum(0).to(w.dtype) if bias else None)
    return weight_grads + bias_grads


def _passes(ctx) -> tuple[bool, bool]:
    """Whether this backward pass wants the entry's input gradient, and its weights'.

    A whole backward wants both. A pipeline's split backward (pipeline/split.py) runs
    this node twice: B for the input only (the weights' accumulators are not in that
    pass), W for the weights only (the input's node is not). The engine says which nodes
    a pass runs; it cannot say for a leaf under ``autograd.grad``, where both are done."""
    def runs(edge: int) -> bool:
        node = ctx.next_functions[edge][0] if edge < len(ctx.next_functions) else None
        try:
            return node is None or torch._C._will_engine_execute_node(node)
        except RuntimeError:  # a leaf, asked during autograd.grad: unknown
            return True
    # next_functions lists the tensor inputs: the entry's input, then the weights.
    return runs(0), runs(1)


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
        """``enter``, with the outputs of ``layers`` (the column-parallel layers reading the
        result) computed by the same Function, which overlaps their weight gradients with
        the backward collective. Each layer is handed its output for this call
        (``ColumnParallelLinear.hand_over``) and returns it when called on the entered input."""
        if not self.overlap:
            return self.enter(x)
        entered, *outputs = EnterColumnParallel.apply(
            x, self, len(layers), *(layer.weight for layer in layers), *(layer.bias for layer in layers))
        for layer, out in zip(layers, outputs):
            layer.hand_over(entered, out)
        return entered

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
