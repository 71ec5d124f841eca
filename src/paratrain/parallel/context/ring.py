"""Ring attention (Liu et al. 2023) for causal attention on the load-balanced layout.

Each rank keeps its queries and passes its key/value block around the cp ring: in p steps
every query meets every key block once. The next block is posted (non-blocking send to the
right neighbour, receive from the left) *before* the current one is computed, so the
transfer hides behind the arithmetic. Partial results are merged with the online softmax:
each block yields an output and the log-sum-exp (LSE) of its scores, and two partial
results combine exactly through their LSEs, kept in fp32.

With the two-chunk layout of ``sharding.py`` (rank r holds chunks r and 2p-1-r) the causal
mask makes every (query rank r, key block from rank j) pair one of three shapes, all of
the same cost (c = the chunk length; see ``block_for``):

* j == r: the diagonal, causal within the local sequence (which is in position order);
* j <  r: all our queries see j's early chunk in full, none sees its late chunk;
* j >  r: only our late chunk sees j, and it sees both of j's chunks in full.

Blocks above the diagonal (our early chunk against j's late chunk, ...) are never computed.

Backward is a ring too. The probabilities of each block are recomputed from the saved
final LSE (nothing of size s^2 is stored); dQ accumulates locally, while dK/dV of a block
travel around the ring with the block, each rank adding its share, and arrive back at
their owner after the p-th hop.

The attention of one block is computed by a ``blocks.BlockKernel`` (plain math, or torch's
fused CPU flash kernel), which also handles grouped KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ...comm import collectives as C
from .blocks import BlockKernel, pick_kernel


@dataclass(frozen=True)
class Block:
    """Which part of one step's attention is computed: local query rows × block key rows."""

    rows: slice
    """Local query rows (of the 2c local tokens) that attend to this K/V block."""
    cols: slice
    """Rows of the K/V block that they attend to."""
    causal: bool
    """Causal mask inside the block (the diagonal step), or full attention."""


def block_for(cp_rank: int, src_rank: int, local_len: int) -> Block:
    """The non-empty part of query shard ``cp_rank`` × K/V shard ``src_rank``."""
    c = local_len // 2
    if src_rank == cp_rank:
        return Block(slice(None), slice(None), causal=True)
    if src_rank < cp_rank:  # their early chunk precedes both of ours; their late follows both
        return Block(slice(None), slice(0, c), causal=False)
    return Block(slice(c, None), slice(None), causal=False)  # both of theirs precede our late


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor, rows: slice) -> None:
    """Fold one block's partial result into the running (out, lse) rows, in place: the
    softmax over the union of keys is each part reweighted by exp(its LSE - joint LSE)."""
    run_out, run_lse = out[..., rows, :], lse[..., rows]
    joint = torch.logaddexp(run_lse, block_lse)
    run_out.mul_(torch.exp(run_lse - joint).unsqueeze(-1))
    run_out.add_(block_out.mul_(torch.exp(block_lse - joint).unsqueeze(-1)))
    run_lse.copy_(joint)


# ---- the ring ------------------------------------------------------------------------------

def rotate(tensor: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, list]:
    """Post: send ``tensor`` to the next rank, receive the previous rank's into a new buffer.
    Returns the buffer and the handles to wait on; a ring of one hands back ``tensor``."""
    p, r = C.size(group), C.rank(group)
    if p == 1:
        return tensor, []
    incoming = torch.empty_like(tensor)
    works = C.send_recv([C.P2P("send", tensor, (r + 1) % p),
                         C.P2P("recv", incoming, (r - 1) % p)], group)
    return incoming, works


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup,
                 kernel: BlockKernel, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out (b, h, n, d) and LSE (b, h, n), fp32, of the local queries q (b, h, n, d)
    against the whole sequence's keys; k, v (b, g, n, d) are this rank's block."""
    p, r = C.size(group), C.rank(group)
    kv = torch.stack([k, v])  # one message per step instead of two
    out = lse = None
    for step in range(p):
        last = step == p - 1
        # Post the next block's transfer first: it travels while we compute on this one.
        incoming, works = (kv, []) if last else rotate(kv, group)
        blk = block_for(r, (r - step) % p, q.shape[2])
        blk_out, blk_lse = kernel.forward(q[..., blk.rows, :], kv[0][..., blk.cols, :],
                                          kv[1][..., blk.cols, :], blk.causal, scale)
        if out is None:  # step 0 is the diagonal: it covers every row
            out, lse = blk_out, blk_lse
        else:
            merge(out, lse, blk_out, blk_lse, blk.rows)
        C.wait_all(works)
        kv = incoming
    return out, lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, group: ProcessGroup,
                  kernel: BlockKernel, scale: float) -> tuple[torch.Tensor, ...]:
    """dq (like q), dk, dv (like k) in fp32; ``out`` and ``lse`` are the forward's."""
    p, r = C.size(group), C.rank(group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv_in, dkv_works = None, []  # dK/dV of the block we hold, from the ranks before us
    for step in range(p):
        last = step == p - 1
        incoming, kv_works = (kv, []) if last else rotate(kv, group)
        blk = block_for(r, (r - step) % p, q.shape[2])
        rows, cols = blk.rows, blk.cols
        dq_b, dk_b, dv_b = kernel.backward(dout[..., rows, :], q[..., rows, :], kv[0][..., cols, :],
                                           kv[1][..., cols, :], out[..., rows, :], lse[..., rows],
                                           blk.causal, scale)
        dq[..., rows, :] += dq_b
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dkv[0][..., cols, :] = dk_b
        dkv[1][..., cols, :] = dv_b
        C.wait_all(dkv_works)  # waited for only now: it arrived while we computed
        if dkv_in is not None:
            dkv += dkv_in
        # dK/dV travel on with their block; the p-th hop brings them home to their owner.
        dkv_in, dkv_works = rotate(dkv, group)
        C.wait_all(kv_works)
        kv = incoming
    C.wait_all(dkv_works)
    return dq, dkv_in[0], dkv_in[1]


class RingAttentionFn(torch.autograd.Function):
    """Causal ring attention over the cp group (load-balanced two-chunk layout).

    forward: rotate this rank's K/V block around the ring (p - 1 overlapped P2P steps),
    computing each non-empty (query, block) part and merging it into the output through
    the fp32 log-sum-exp; saves q, k, v, the output and the LSE.
    backward: rotate K/V again, recompute each block's probabilities from the saved LSE,
    accumulate dQ locally and send dK/dV around the ring with their block (p hops) back
    to the rank that owns them.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup,
                kernel: BlockKernel) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        # Under autocast the kernels' matmuls would drop to bf16: they choose precision.
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, group, kernel, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kernel, ctx.scale = group, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.kernel,
                                   ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class RingAttention(nn.Module):
    """Drop-in for ``Attention.core``: causal attention over the whole sequence while each
    rank of ``cp_group`` holds its load-balanced shard (``sharding.shard_sequence``).

    q is (batch, heads, s_local, head_dim); k and v may have fewer (grouped) heads.
    ``kernel`` computes each block: "auto" (fused flash on CPU, else math), "math",
    "flash_cpu", or a ``blocks.BlockKernel``.
    """

    def __init__(self, cp_group: ProcessGroup, kernel: str | BlockKernel = "auto"):
        super().__init__()
        self.cp_group = cp_group
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_qkv(q, k, v)
        kernel = pick_kernel(self.kernel, q.device)
        return RingAttentionFn.apply(q, k, v, self.cp_group, kernel)

    def extra_repr(self) -> str:
        name = self.kernel if isinstance(self.kernel, str) else self.kernel.name
        return f"cp={C.size(self.cp_group)}, kernel={name}"


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError unless q, k, v are a load-balanced shard with grouped KV heads."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q (b, heads, s, d) and k, v (b, kv_heads, s, d); got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if q.shape[2] % 2:
        raise ValueError(f"a context-parallel shard holds two equal chunks of the sequence, "
                         f"but has {q.shape[2]} tokens; shard with sharding.shard_sequence "
                         f"a sequence whose length divides by 2*cp")
