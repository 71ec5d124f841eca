"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade sequence sharding for head sharding.

Before attention, one all-to-all per tensor turns q, k, v from "all heads, my tokens"
(b, heads, s/cp, d) into "my heads, all tokens" (b, heads/cp, s, d); each rank then runs
ordinary causal attention on its heads over the whole sequence, and a second all-to-all
turns the output back. Attention heads are independent, so nothing else is needed: the
communication volume per rank is O(s·h/cp), independent of the number of ranks' blocks.

Layout: Ulysses works with any sharding as long as the all-to-all reassembles the sequence
in position order. paratrain uses the same load-balanced two-chunk layout as ring
attention (one layout for the training loop, whatever the method), so after the
all-to-all the received shards are put back in order with ``sharding.unshard_sequence``
and, on the way back, cut out again with the chunk order of each rank.

Requirement: cp divides both the query heads and the KV heads a rank holds (heads are
what gets split). With grouped KV heads this keeps each query head on the rank holding its
KV head: rank i gets query heads [i·h/cp, (i+1)·h/cp) and KV heads [i·g/cp, (i+1)·g/cp),
and query head j uses KV head j // (h/g) in both the full and the split model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ... import rules
from ...comm import collectives as C
from ...models.gpt import CausalAttention
from .ring import check_qkv
from .sharding import chunk_ids, unshard_sequence


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, h, s/cp, d) sequence shard -> (b, h/cp, s, d) head shard, sequence in order."""
    p = C.size(group)
    b, h, n, d = x.shape
    # Head group j goes to rank j: make it the leading (all-to-all) dimension.
    send = x.reshape(b, p, h // p, n, d).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group)
    return unshard_sequence(list(recv.unbind(0)), dim=2)  # recv[i]: rank i's tokens


def heads_to_seq(y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(b, h/cp, s, d) head shard -> (b, h, s/cp, d) sequence shard (inverse of the above)."""
    p = C.size(group)
    b, hp, s, d = y.shape
    chunks = y.chunk(2 * p, dim=2)
    c = s // (2 * p)
    send = torch.empty((p, b, hp, 2 * c, d), dtype=y.dtype, device=y.device)
    for rank in range(p):  # rank j gets back its own two chunks of the sequence
        first, second = chunk_ids(rank, p)
        send[rank, :, :, :c] = chunks[first]
        send[rank, :, :, c:] = chunks[second]
    recv = torch.empty_like(send)
    C.all_to_all(recv, send, group)
    return recv.movedim(0, 1).reshape(b, p * hp, 2 * c, d)  # recv[j]: head group j


class SeqToHeads(torch.autograd.Function):
    """Ulysses' first all-to-all.

    forward: sequence-sharded (b, h, s/cp, d) -> head-sharded (b, h/cp, s, d).
    backward: the reverse all-to-all of the gradient (head-sharded -> sequence-sharded).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """Ulysses' second all-to-all.

    forward: head-sharded attention output (b, h/cp, s, d) -> sequence-sharded (b, h, s/cp, d).
    backward: the reverse all-to-all of the gradient (sequence-sharded -> head-sharded).
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return seq_to_heads(grad.contiguous(), ctx.group), None


def check_heads(heads: int, kv_heads: int, cp_size: int) -> None:
    """Raise LayoutError (a ValueError) unless Ulysses can split this rank's ``heads`` and
    ``kv_heads`` over cp ranks (the rule is ``rules.context``)."""
    rules.context(cp_size, "ulysses", 0, heads, kv_heads)


class UlyssesAttention(nn.Module):
    """Drop-in for ``Attention.core``: causal attention over the whole sequence while each
    rank of ``cp_group`` holds its load-balanced shard (``sharding.shard_sequence``).

    q is (batch, heads, s_local, head_dim); k and v may have fewer (grouped) heads.
    """

    def __init__(self, cp_group: ProcessGroup):
        super().__init__()
        self.cp_group = cp_group
        self.local = CausalAttention()  # the plain model's attention, on whole sequences

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_qkv(q, k, v)
        check_heads(q.shape[1], k.shape[1], C.size(self.cp_group))
        q, k, v = (SeqToHeads.apply(t, self.cp_group) for t in (q, k, v))
        return HeadsToSeq.apply(self.local(q, k, v), self.cp_group)

    def extra_repr(self) -> str:
        return f"cp={C.size(self.cp_group)}"
