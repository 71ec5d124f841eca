"""Communication on a link, and what of it a step sees when it overlaps compute.

A collective costs α-β ring time (``paratrain.comm.cost``) on the link its group crosses,
or with the cluster's own measured α and β for that collective. Overlapped with a window
of compute, the part longer than the window shows (``exposed``), and the hidden part
still costs the cluster's ``overlap_cost`` of itself: on GPUs NCCL's kernels take SMs
from the compute; on CPU processes that fill every core, gloo's threads take the cores
(measured: a collective in flight beside compute costs the step about its whole time).
Per-unit collectives issued one unit ahead (ZeRO-3's gathers) show as ``prefetched``.
"""

from __future__ import annotations

from functools import lru_cache

from ..comm import cost as alpha_beta
from .hardware import Cluster, Link

# The search asks the same questions many times: remember the answers.
collective_time = lru_cache(maxsize=1 << 16)(alpha_beta.collective_time)
p2p_time = lru_cache(maxsize=1 << 12)(alpha_beta.p2p_time)


def _alpha_beta(cluster: Cluster, link: Link, op: str) -> tuple[float, float]:
    """The cluster's measured α and β for ``op`` if it has them, else the link's."""
    return next(((a, b) for name, a, b in cluster.gpu.collectives if name == op),
                (link.alpha, link.bw))


def link_collective_time(cluster: Cluster, link: Link, op: str, nbytes: float, p: int) -> float:
    """``op`` over ``link``, with the cluster's measured α and β for ``op`` if it has them."""
    return collective_time(op, nbytes, p, *_alpha_beta(cluster, link, op))


def exposed(comm: float, window: float, overlap_cost: float = 0.1) -> float:
    """Cost of ``comm`` seconds of communication overlapped with ``window`` of compute,
    of which ``overlap_cost`` of the hidden part still slows the step."""
    return max(0.0, comm - window) + overlap_cost * min(comm, window)


def prefetched(comm: float, compute: float, units: int, overlap_cost: float) -> float:
    """Exposed seconds of ``units`` collectives of ``comm`` seconds each, each unit's issued
    one unit ahead (prefetch depth 1) while the unit before it computes for ``compute``:
    the first is waited for, every later one shows where it is longer than the compute
    beside it. A deeper prefetch changes neither term for equal units: the link is busy
    either way; it only holds more gathered units in memory."""
    return comm + (units - 1) * exposed(comm, compute, overlap_cost)
