"""What differs between backends, behind one function each, so that strategies hold no
backend branches of their own.

gloo (CPU) has slow flat collectives: its native reduce-scatter and all-gather are slower
than its own all-reduce and than a ring of sends and receives (``paratrain bench comm``);
NCCL's are the fast path. (The pipeline's other backend choice, how early receives are
posted, is ``pipeline.posting.receives_ahead``: the planner reads it without torch.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import collectives as C
from .compress import all_reduce_bytes
from .ring import ring_all_gather

def ring_path(group: ProcessGroup, ring: bool | None = None) -> bool:
    """Whether the flat collectives on ``group`` take gloo's path (an all-reduce for a
    reduce-scatter, a ring of sends for an all-gather). ``ring`` decides when given: False
    runs NCCL's path on gloo, so the code GPUs run is code the CPU suite runs."""
    return dist.get_backend(group) == "gloo" if ring is None else ring


def average_into_shard(buffer: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                       ring: bool | None = None):
    """Launch the average of ``buffer`` over ``group`` so that ``shard`` (this rank's slice,
    a view of ``buffer``) holds its part; returns the work handle. On gloo the whole buffer
    is all-reduced: the same slice results, sooner."""
    if ring_path(group, ring):
        return C.all_reduce(buffer, group, op="avg", async_op=True)
    return C.reduce_scatter(shard, buffer, group, op="avg", async_op=True)


def average_into_shard_bytes(nbytes: int, group: ProcessGroup, ring: bool | None = None) -> int:
    """Bytes this rank sends in ``average_into_shard`` of an ``nbytes`` buffer."""
    sent = all_reduce_bytes(nbytes, C.size(group))
    return sent if ring_path(group, ring) else sent // 2


def gather_shards(pairs: list[tuple[torch.Tensor, torch.Tensor]], group: ProcessGroup,
                  ring: bool | None = None) -> None:
    """For each (full, mine) pair, where ``mine`` is this rank's slice of ``full``, fill
    ``full`` with every rank's slice."""
    if ring_path(group, ring):
        for full, mine in pairs:
            ring_all_gather(mine, group, out=full)
    else:
        C.wait_all([C.all_gather(full, mine, group, async_op=True) for full, mine in pairs])

