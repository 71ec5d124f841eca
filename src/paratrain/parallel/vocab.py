"""The vocabulary split over the tensor-parallel group: embedding lookup and a
cross-entropy that never gathers the full logits (Megatron-LM).

The vocabulary is padded to a multiple of t; rank r holds rows [r*V/t, (r+1)*V/t). The
padding rows exist on the last rank but are never looked up, and the loss gives them
-inf logits, so they get no probability and no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..models.gpt import IGNORE_INDEX
from .sequence import Regions


def padded_size(n: int, t: int) -> int:
    """``n`` rounded up to a multiple of ``t``."""
    return math.ceil(n / t) * t


def shard_rows(weight: torch.Tensor, num_shards: int, shard: int, padded: int) -> torch.Tensor:
    """Rows ``shard`` of ``num_shards`` equal pieces of ``weight``, zero-padded to ``padded`` rows."""
    if padded > weight.shape[0]:
        weight = torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])
    return weight.detach().chunk(num_shards, dim=0)[shard].clone()


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary, padded to a multiple of t) are split
    over the group.

    Each rank looks up the tokens inside its vocabulary range and writes zeros for the
    others; ``exit`` (all-reduce, or reduce-scatter along the sequence under sequence
    parallelism) sums the ranks' partial embeddings. Padding rows are never looked up.
    """

    def __init__(self, embedding: nn.Embedding, group: ProcessGroup, regions: Regions):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding does not support padding_idx or max_norm")
        t = C.size(group)
        self.vocab_size = embedding.num_embeddings
        padded = padded_size(self.vocab_size, t)
        self.weight = nn.Parameter(shard_rows(embedding.weight, t, C.rank(group), padded))
        self.vocab_start = C.rank(group) * self.weight.shape[0]
        self.regions = regions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.regions.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_start + self.weight.shape[0]} of {self.vocab_size}"


class VocabParallelCrossEntropyFn(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, summed over tokens.

    Forward: subtract the global max (all-reduce max), then one all-reduce of the
    concatenated [sum of exp, target logit] (the target logit lives on one rank, the others
    contribute zero); loss = log(sum exp) - target logit. Padding columns are -inf.
    Backward: softmax minus one-hot of the target on this rank's columns, scaled by the
    incoming gradient; ignored targets get zero. No communication.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup,
                vocab_size: int) -> torch.Tensor:
        shard = logits.shape[-1]
        start = C.rank(group) * shard
        x = logits.reshape(-1, shard).float().clone()  # clone: exp and softmax below run in place
        valid_cols = max(0, min(shard, vocab_size - start))
        if valid_cols < shard:
            x[:, valid_cols:] = float("-inf")
        peak = x.max(dim=-1).values
        C.all_reduce(peak, group, op="max")
        x -= peak.unsqueeze(-1)
        t = targets.reshape(-1) - start
        mine = (t >= 0) & (t < shard)
        rows = torch.arange(x.shape[0], device=x.device)
        local_t = t.masked_fill(~mine, 0)
        target_logit = x[rows, local_t].masked_fill(~mine, 0.0)
        x.exp_()
        both = torch.cat([x.sum(dim=-1), target_logit])
        C.all_reduce(both, group)
        sum_exp, target_logit = both.chunk(2)
        keep = targets.reshape(-1) != IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(~keep, 0.0).sum()
        x /= sum_exp.unsqueeze(-1)  # softmax, kept for backward
        ctx.save_for_backward(x, local_t, mine, keep)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_t, mine, keep = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        g = softmax  # reused in place: backward runs once (no retain_graph through the loss)
        g[rows, local_t] -= mine.to(g.dtype)
        g *= (keep.to(g.dtype) * grad).unsqueeze(-1)
        return g.view(ctx.shape).to(ctx.dtype), None, None, None


class VocabParallelCrossEntropy(nn.Module):
    """Replacement for ``GPT.loss_fn``: (b, s, V_padded / t) logits of this rank and the full
    (b, s) targets -> sum of the token losses over targets != IGNORE_INDEX, equal on every
    rank of ``group``. Full logits are never gathered."""

    def __init__(self, group: ProcessGroup, vocab_size: int):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return VocabParallelCrossEntropyFn.apply(logits, targets, self.group, self.vocab_size)
