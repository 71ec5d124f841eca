"""Which tokens a context-parallel rank holds: the load-balanced two-chunk layout.

Under a causal mask, token t attends to t + 1 keys, so a contiguous split of the sequence
would give the last rank ~2·cp−1 times the attention work of the first. Instead the
sequence is cut into 2·cp equal chunks and rank i holds chunks i and 2·cp−1−i: one early
(cheap) chunk and its mirror late (expensive) chunk, so every rank does the same work.

    cp = 2, 4 chunks:   rank 0 -> [c0, c3]   rank 1 -> [c1, c2]

Both ring attention and Ulysses use this one layout (Ulysses does not care how the
sequence is split as long as it reassembles it in order; see ``ulysses.py``), so the
training loop shards tokens, targets and positions the same way whatever the method.
The local tokens of a rank are always in increasing position order (i < 2·cp−1−i).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ...comm import collectives as C


def check_divisible(seq_len: int, cp_size: int) -> None:
    """Raise ValueError unless ``seq_len`` splits into 2·cp equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallelism with cp={cp_size} splits the sequence into 2*cp={2 * cp_size} "
            f"chunks for causal load balance, but seq_len={seq_len} is not divisible by "
            f"{2 * cp_size}; use a seq_len that is a multiple of {2 * cp_size} (or pad)")


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that rank ``cp_rank`` holds, in increasing order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a cp group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced shard of ``x`` along ``dim`` (the sequence dimension):
    chunks ``cp_rank`` and ``2·cp−1−cp_rank`` of 2·cp, concatenated. Returns a copy."""
    check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def positions_for(cp_rank: int, cp_size: int, seq_len: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (for RoPE) of the tokens ``shard_sequence`` gives this rank."""
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


def unshard_sequence(shards: list[torch.Tensor] | torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full sequence from every rank's shard, given in
    cp-rank order (a list, or a tensor stacked along a new leading dimension)."""
    halves = [shard.chunk(2, dim=dim) for shard in shards]
    # Chunk c < cp is the first half of rank c; chunk 2cp-1-c the second half of rank c.
    ordered = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    return torch.cat(ordered, dim=dim)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The full sequence on every rank of ``group`` from each rank's shard (for tests and
    evaluation; not differentiable)."""
    stacked = torch.empty((C.size(group), *x.shape), dtype=x.dtype, device=x.device)
    C.all_gather(stacked.view(-1), x.contiguous().view(-1), group)
    return unshard_sequence(list(stacked.unbind(0)), dim=dim)


def shard_batch(tokens: torch.Tensor, targets: torch.Tensor, cp_rank: int,
                cp_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(tokens, targets, positions)`` of a (batch, seq) batch: exactly what
    a cp rank passes to ``GPT.forward(tokens, targets, positions)``."""
    positions = positions_for(cp_rank, cp_size, tokens.shape[1], device=tokens.device)
    return (shard_sequence(tokens, cp_rank, cp_size), shard_sequence(targets, cp_rank, cp_size),
            positions)
