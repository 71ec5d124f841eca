"""gloo's α and β for the local cluster (``paratrain plan --cluster local --calibrate``,
``plan/calibrate.py``): all-reduce, all-gather, reduce-scatter and all-to-all timed in
spawned worlds of 2 and 4 processes at several sizes, then the least-squares fit of
``comm.cost.fit_alpha_beta``.

A collective's time is the mean over 32 samples of the slowest rank's (a collective waits
for it). Means, not medians: after compute, a gloo collective on this kind of machine
either finds its peers' threads awake or pays a wake-up of 2-4 ms, and the median of such
a two-valued sample flips between the two from one calibration to the next (the
2-process all-to-all's α read 0.3, 0.8 and 1.2 ms in three calibrations), while a step of
many collectives pays their mean (1.3-2.0 ms in the same three).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
"""What data parallelism, ZeRO and Ulysses run; gloo's all-gather, reduce-scatter and
all-to-all do not cost what ring algorithms would next to its all-reduce, so each gets
its own fit."""
COLLECTIVE_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Bytes of the timed collectives: from latency- to bandwidth-bound."""


def _collective_times(ops: list[str], sizes: list[int], iters: int
                      ) -> dict[str, list[float]] | None:
    """On every rank of a spawned world: for each op and size (nccl-tests' size: the
    full tensor), the mean over ``iters`` of the slowest rank's time (the module
    docstring says why the mean). Rank 0 returns them, the others None."""
    import torch
    import torch.distributed as dist

    from ..comm import collectives as C

    group = dist.group.WORLD
    p = dist.get_world_size()
    times: dict[str, list[float]] = {op: [] for op in ops}
    for op in ops:
        for nbytes in sizes:
            full, part = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // p)
            call = {"all-reduce": functools.partial(C.all_reduce, full, group, op="avg"),
                    "all-gather": functools.partial(C.all_gather, full, part, group),
                    "reduce-scatter": functools.partial(C.reduce_scatter, part, full, group,
                                                        op="avg"),
                    "all-to-all": functools.partial(C.all_to_all, torch.empty_like(full), full,
                                                    group)}[op]
            call()  # warm-up: connections, buffers
            samples = torch.zeros(iters, dtype=torch.float64)
            a = torch.randn(256, 256)
            for i in range(iters):
                dist.barrier(group)  # start together: no rank times its wait for a peer
                for _ in range(8):  # as in a training step, the collective follows compute:
                    a = torch.tanh(a @ a)  # gloo's threads have slept, caches hold other data
                start = time.perf_counter()
                call()
                samples[i] = time.perf_counter() - start
            dist.all_reduce(samples, op=dist.ReduceOp.MAX, group=group)  # the last rank's
            times[op].append(statistics.fmean(samples.tolist()))
    return times if dist.get_rank() == 0 else None


def collective_alpha_beta(n_procs: int, iters: int = 32) -> dict[str, list[float]]:
    """[α (s), β (bus bytes/s)] of each of ``COLLECTIVES`` for ``n_procs`` local
    processes."""
    from ..comm.cost import fit_alpha_beta
    from ..launch import spawn

    sizes = [n // (4 * n_procs) * 4 * n_procs for n in COLLECTIVE_SIZES]  # even chunks
    times = spawn(_collective_times, n_procs, list(COLLECTIVES), sizes, iters,
                  backend="gloo", timeout_s=300)[0]
    return {op: list(fit_alpha_beta(op, n_procs, sizes, times[op])) for op in COLLECTIVES}


def comm_fits(worlds: tuple[int, ...] = (2, 4), log: Callable[[str], None] = print) -> dict:
    """gloo's α-β fits of every collective for each world size in ``worlds``, as
    ``Calibration`` fields (``comm``, and the first world's all-reduce as ``alpha``,
    ``beta`` and ``world_size``)."""
    comm = {}
    for n in worlds:
        comm[str(n)] = collective_alpha_beta(n)
        for op, (alpha, beta) in comm[str(n)].items():
            log(f"gloo {op:<15}{n} processes: alpha {alpha * 1e6:.0f} us, beta "
                f"{beta / 1e9:.2f} GB/s (bus bandwidth)")
    alpha, beta = comm[str(worlds[0])]["all-reduce"]
    return dict(comm=comm, alpha=alpha, beta=beta, world_size=worlds[0])
