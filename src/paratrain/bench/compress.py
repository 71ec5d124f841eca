"""The arithmetic of one compressed gradient reduction, timed alone.

Over a group of one rank the collectives move nothing, so what is left is the
compressor's own work: casting, quantizing, selecting, projecting, and error feedback.
On a machine whose cores the training already fills, that work adds to every step
whatever the link, so it bounds what compression can gain there
(``benchmarks/two_nodes.py`` prints it next to each method's step time).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..comm.compress import make_compressor, parse
from ..parallel.data import make_buckets


def reduction_seconds(method: str, views: list[tuple[int, torch.Size]], numel: int,
                      solo: ProcessGroup, repeats: int = 10, seed: int = 0) -> float:
    """Median seconds of one ``method`` reduction of a bucket of random gradients over
    ``solo`` (a group of this rank alone), compressed from the first reduction."""
    compressor = make_compressor(parse(method), views, numel, seed)
    gen = torch.Generator().manual_seed(seed)
    bucket, times = torch.empty(numel), []
    for _ in range(repeats + 2):  # the first two fill caches and lazy buffers
        bucket.copy_(torch.randn(numel, generator=gen))
        start = time.perf_counter()
        compressor.reduce(bucket, solo).wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def arithmetic(methods: list[str], model: torch.nn.Module) -> dict[str, float]:
    """``reduction_seconds`` of each method on one bucket of all of ``model``'s parameters,
    laid out as data parallelism lays it out, timed by rank 0 alone while the other ranks
    wait (so it has a core to itself); every rank must call it, and gets the numbers on
    rank 0 only."""
    solo, _ = dist.new_subgroups(1)
    got = {}
    if dist.get_rank() == 0:
        params = [p for p in model.parameters() if p.requires_grad]
        bucket = make_buckets(params[::-1], bucket_bytes=1 << 62)[0]  # one bucket, DDP's order
        views = [(bucket.offsets[p], p.shape) for p in bucket.params]
        got = {method: reduction_seconds(method, views, bucket.buffer.numel(), solo)
               for method in methods}
    dist.barrier()
    return got
