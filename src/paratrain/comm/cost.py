"""The α-β cost model of collectives, and nccl-tests' bus bandwidth. Pure functions.

A message of m bytes over one link costs ``α + m/β``: α is the latency in seconds, β the
bandwidth in bytes per second. The bandwidth-optimal ring algorithms on p ranks
(``paratrain.comm.ring``; NCCL's rings) take a number of latency-bound steps and push a
fixed multiple of the tensor through each rank's link, so every collective costs

    time = steps(op, p) · α  +  busbw_factor(op, p) · n / β

| op             | steps    | busbw_factor | n is the bytes of ...                    |
|----------------|----------|--------------|------------------------------------------|
| all-reduce     | 2(p − 1) | 2(p − 1)/p   | the tensor reduced                        |
| all-gather     | p − 1    | (p − 1)/p    | the full, gathered output                 |
| reduce-scatter | p − 1    | (p − 1)/p    | the full input (p chunks)                 |
| all-to-all     | p − 1    | (p − 1)/p    | each rank's input (= its output)          |
| broadcast      | p − 1    | 1            | the tensor broadcast                      |
| p2p            | 1        | 1            | the message                               |

n follows nccl-tests' convention (its "size" column), so ``busbw = factor · n / time`` is
the number nccl-tests prints: the bandwidth each link achieved, comparable across ops and
group sizes, and equal to β when latency is negligible. ``algbw = n / time`` is what the
caller sees. Broadcast is modelled as NCCL does it, pipelined along a chain: the data
crosses p − 1 links but each link carries it once, so its bandwidth term is n/β.

A group of one rank communicates nothing: every collective's time is 0.
"""

from __future__ import annotations

from typing import Sequence

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "p2p")


def _normalize(op: str) -> str:
    name = op.lower().replace("_", "-")
    aliases = {"allreduce": "all-reduce", "allgather": "all-gather",
               "reducescatter": "reduce-scatter", "alltoall": "all-to-all",
               "send-recv": "p2p", "sendrecv": "p2p"}
    name = aliases.get(name, name)
    if name not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
    return name


def _check(p: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"group size p must be a positive integer, got {p!r}")


def latency_steps(op: str, p: int) -> int:
    """Number of sequential messages (each costing α) a ring ``op`` over p ranks takes."""
    op = _normalize(op)
    _check(p)
    if op == "p2p":
        return 1
    if p == 1:
        return 0
    return 2 * (p - 1) if op == "all-reduce" else p - 1


def busbw_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw: the bytes each rank's link carries per byte of ``n``.

    2(p − 1)/p for all-reduce; (p − 1)/p for all-gather, reduce-scatter and all-to-all;
    1 for broadcast and p2p.
    """
    op = _normalize(op)
    _check(p)
    if op in ("broadcast", "p2p"):
        return 1.0
    factor = (p - 1) / p
    return 2 * factor if op == "all-reduce" else factor


def collective_time(op: str, nbytes: float, p: int, alpha: float, beta: float) -> float:
    """α-β time in seconds of ``op`` on ``nbytes`` (nccl-tests' n, see the table above)
    over p ranks, with latency ``alpha`` seconds and bandwidth ``beta`` bytes/second."""
    if nbytes < 0 or alpha < 0 or beta <= 0:
        raise ValueError(f"need nbytes >= 0, alpha >= 0, beta > 0; got "
                         f"nbytes={nbytes}, alpha={alpha}, beta={beta}")
    if _normalize(op) != "p2p" and p == 1:
        return 0.0
    return latency_steps(op, p) * alpha + busbw_factor(op, p) * nbytes / beta


def all_reduce_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce: 2(p − 1)·α + 2(p − 1)/p · n/β."""
    return collective_time("all-reduce", nbytes, p, alpha, beta)


def all_gather_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-gather of an n-byte output: (p − 1)·α + (p − 1)/p · n/β."""
    return collective_time("all-gather", nbytes, p, alpha, beta)


def reduce_scatter_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of an n-byte input: (p − 1)·α + (p − 1)/p · n/β."""
    return collective_time("reduce-scatter", nbytes, p, alpha, beta)


def all_to_all_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """All-to-all of n bytes per rank, p − 1 pairwise exchanges: (p − 1)·α + (p − 1)/p · n/β."""
    return collective_time("all-to-all", nbytes, p, alpha, beta)


def broadcast_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Pipelined chain broadcast: (p − 1)·α + n/β."""
    return collective_time("broadcast", nbytes, p, alpha, beta)


def p2p_time(nbytes: float, alpha: float, beta: float) -> float:
    """One point-to-point message: α + n/β."""
    return collective_time("p2p", nbytes, 2, alpha, beta)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/second: n / time, as nccl-tests reports it."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds


def busbw(op: str, nbytes: float, seconds: float, p: int) -> float:
    """Bus bandwidth in bytes/second: algbw × ``busbw_factor(op, p)``."""
    return algbw(nbytes, seconds) * busbw_factor(op, p)


def fit_alpha_beta(op: str, p: int, nbytes: Sequence[float],
                   seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares α (seconds) and β (bytes/second) from measured times of ``op``.

    Fits ``time = steps·α + factor·n/β`` (a line in n) to the points. α is clamped at 0:
    at small sizes measured times are noise around the latency.
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("need the times of at least two different sizes")
    steps, factor = latency_steps(op, p), busbw_factor(op, p)
    if steps == 0:
        raise ValueError("a group of one rank moves no data: nothing to fit")
    xs = [factor * n for n in nbytes]
    mean_x, mean_t = sum(xs) / len(xs), sum(seconds) / len(seconds)
    cov = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, seconds))
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = cov / var  # seconds per byte on one link: 1/β
    if slope <= 0:
        raise ValueError("measured times do not grow with size: no bandwidth to fit")
    alpha = max(0.0, (mean_t - slope * mean_x) / steps)
    return alpha, 1.0 / slope
