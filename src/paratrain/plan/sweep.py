"""Time one candidate at every microbatch size and recompute policy that fits, and leave
out what cannot come within ``Problem.within`` of the fastest plan found so far.

**The bound.** For a candidate at recompute policy r whose largest fitting microbatch
is b, every size up to b steps in at least the time of size b without its bubble:

    T(size) >= T_b - bubble_b      for every size <= b that fits

because each term is a per-microbatch cost X paid m = B / size times (B sequences per
replica), and X(size) / size never grows with the size: a GEMM, attention or
collective costs a fixed latency plus a part that grows with the rows (or, overlapped,
the exposed part of two such), and the GEMM curve's efficiency only grows with them.
The data-parallel and optimizer terms shrink with fewer, larger microbatches too (the
backward window that hides the gradient reduction is longer; ZeRO-2/3 reduce and
gather once per microbatch). Dropping the bubble keeps it a bound whatever the
schedule. More recompute only adds time, so a candidate is first bounded at its least
recompute and largest size (``family_bound``, before any memory is counted: the search
orders candidates by it). ``tests/test_plan_bound.py`` checks the bound against every
plan of exhaustive searches, and that a bounded search ranks the same plans within
its factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import rules
from ..layout import LayoutError
from .candidate import Candidate, Training
from .cost import step_time
from .hardware import GiB, Cluster
from .memory import (Memory, _state_bytes, inflight_microbatches, layer_activation_bytes,
                     rank_memory, rank_states)
from .models import ModelSpec
from .results import Plan, SearchResult


@dataclass(frozen=True)
class Problem:
    """What every candidate of one search shares."""

    model: ModelSpec
    """The model being planned."""
    training: Training
    """Batch, sequence, precision, optimizer."""
    cluster: Cluster
    """Where it runs."""
    micro_batch: int | None
    """A fixed microbatch size, or None to search them."""
    policies: tuple[str, ...]
    """Recompute policies to try, least recompute first."""
    model_flops: float
    """FLOPs of one step without recompute (for MFU)."""
    context_parallel: bool = True
    """Search cp > 1 (False: a framework without context parallelism)."""
    sequence_parallel: bool = True
    """Sequence parallelism with tp > 1 (False: a framework without it)."""
    hsdp: bool = True
    """Search hybrid sharding (HSDP) for ZeRO-3 across nodes."""
    uneven_stages: bool = True
    """Allow pipeline stages with unequal block counts (False: layers % pp == 0, as
    Megatron-LM required before 2023)."""
    ulysses: bool = True
    """Search Ulysses beside ring attention for cp > 1 (False: a framework without it)."""
    zero_bubble: bool = True
    """Search the zero-bubble schedules (zbh1, zbv, dualpipev) beside 1F1B and interleaved
    (False: a framework, or a published run, without them)."""
    within: float | None = None
    """Rank only plans within this factor of the fastest (1.25: up to 25% slower); what
    the bound shows cannot come that close is tallied, not timed. None: time everything."""
    refuse: tuple[str, Callable[[Candidate], str | None]] | None = None
    """(a trainer's name, why it cannot run a candidate or None): plans it refuses are
    tallied, not ranked, so the bound measures from the fastest plan it runs."""

    @property
    def paratrain(self) -> bool:
        """Count memory as paratrain's own runtime holds it (processes on this machine
        run paratrain), not by the published formulas."""
        return self.cluster.kind == "local"

    def sizes(self, cand: Candidate) -> tuple[int, ...]:
        """The microbatch sizes of ``cand`` to try, ascending."""
        from .search import divisors

        return ((self.micro_batch,) if self.micro_batch
                else divisors(self.training.global_batch // cand.dp))

    def reach(self, result: SearchResult) -> float:
        """The slowest step time still ranked: ``within`` times the fastest so far."""
        return self.within * result.fastest if self.within else float("inf")


def family_reach(problem: Problem, cand: Candidate) -> tuple[float, tuple[int, ...]]:
    """(a lower bound on the step time of every plan of ``cand``'s layout and schedule,
    the microbatch sizes at which one may fit), at any ZeRO stage and recompute: for
    each policy, the largest size whose ``memory_floor`` fits bounds the sizes below it
    (the floor never shrinks with the size), at its compute and communication alone,
    without the bubble and the data-parallel and optimizer terms (``_bound``'s, less
    those that depend on the ZeRO stage). paratrain's own runtime (the local cluster)
    counts memory its own way: every size, at the least recompute."""
    sizes = problem.sizes(cand)
    if problem.paratrain:
        return _compute_bound(problem, cand.but(recompute=problem.policies[0]), sizes[-1]), sizes
    bound, fits = float("inf"), 0
    for policy in problem.policies:
        least = cand.but(zero=3, recompute=policy)
        n = _count_fitting(problem, least, sizes)
        if n:
            bound = min(bound, _compute_bound(problem, least, sizes[n - 1]))
        fits = max(fits, n)
    return bound, sizes[:fits]


def _count_fitting(problem: Problem, cand: Candidate, sizes: tuple[int, ...]) -> int:
    """How many of ``sizes`` (ascending) ``cand``'s ``memory_floor`` fits, by bisection."""
    lo, hi, limit = 0, len(sizes) - 1, problem.cluster.memory_limit
    while lo <= hi:
        mid = (lo + hi) // 2
        if memory_floor(problem, cand, sizes[mid]) <= limit:
            lo = mid + 1
        else:
            hi = mid - 1
    return lo


def memory_floor(problem: Problem, cand: Candidate, mb: int) -> float:
    """A lower bound on the peak bytes of ``cand``'s layout, schedule and recompute at
    microbatch size ``mb`` and any ZeRO stage: fully sharded states (ZeRO-3's) and the
    activations of the fewest microbatches the schedule holds at its peak (one for a V
    short of 2 x pp microbatches, whose tables vary), without buffers."""
    model, training = problem.model, problem.training
    least = cand.but(zero=3, micro_batch=mb, microbatches=training.global_batch // cand.dp // mb)
    per_layer = layer_activation_bytes(model, training.seq_len // cand.cp, mb, cand.tp, cand.sp,
                                       cand.recompute, training.act_bytes,
                                       training.flash_attention)
    m, p, v = least.microbatches, cand.pp, cand.virtual_stages
    short_v = cand.schedule in ("zbv", "dualpipev") and m < 2 * p

    def stage(s: int) -> float:
        alive = 1.0 if short_v else inflight_microbatches(cand.schedule, p, m, v, s)
        return sum(_state_bytes(model, training, least, s)) + alive * per_layer * \
            model.stage_layers(p, s, v)

    return max(stage(s) for s in {0, p - 1})


def _compute_bound(problem: Problem, cand: Candidate, mb: int) -> float:
    t = _time(problem, cand.but(zero=0), mb)
    return t.compute + t.tp + t.cp + t.pp + (t.ep or 0.0)


def _bound(problem: Problem, cand: Candidate, mb: int) -> float:
    """A lower bound on the step time of ``cand`` at any microbatch size up to ``mb``."""
    t = _time(problem, cand, mb)
    return t.step - t.bubble


def _time(problem: Problem, cand: Candidate, mb: int):
    return step_time(problem.model, problem.training, problem.cluster,
                     _trial(cand, mb, problem.training.global_batch // cand.dp // mb))


def _trial(cand: Candidate, mb: int, m: int) -> Candidate:
    return Candidate(cand.layout, cand.zero, mb, m, cand.schedule, cand.virtual_stages,
                     cand.recompute, cand.sequence_parallel, cand.shard_group, cand.cp_method,
                     cand.reshard_after_forward)


def _out_of_reach(problem: Problem, cand: Candidate, result: SearchResult, count: int,
                  bound: float) -> None:
    result.reject(f"cannot come within {problem.within:g}x of the fastest",
                  cand.describe().rsplit(" mb", 1)[0],
                  lambda: f"at least {bound:.3g} s a step, the fastest {result.fastest:.3g} s",
                  count=count)


def sweep(problem: Problem, cand: Candidate, result: SearchResult,
          skip: set[tuple[str, int]], sizes: tuple[int, ...] | None = None) -> set[tuple[str, int]]:
    """Every microbatch size and recompute policy of ``cand``. A policy is tried only on
    the microbatches where less recompute did not fit: where it fits, less recompute is
    at least as fast (same everything, less compute). (policy, microbatch) pairs in
    ``skip`` fit with a lower ZeRO stage and are not timed; returns the pairs that fit
    or were skipped. ``sizes``: the microbatch sizes to try (``problem.sizes``)."""
    sizes = sizes or problem.sizes(cand)
    fitted: set[tuple[str, int]] = set()
    if not _states_fit(problem, cand, len(problem.policies) * len(sizes), result):
        return fitted
    if problem.within and _out_of_reach_at_any_policy(problem, cand, sizes, result):
        return fitted
    first = 0
    for policy in problem.policies:
        result.dominated += first
        first = _sweep_microbatch(problem, cand.but(recompute=policy), sizes, first, result,
                                  skip, fitted)
    return fitted


def _out_of_reach_at_any_policy(problem: Problem, cand: Candidate, sizes: tuple[int, ...],
                                result: SearchResult) -> bool:
    """Whether no plan of ``cand`` can come within reach, tallied if so: the least
    recompute's bound at the largest size that fits with the most recompute (memory never
    grows with more recompute: one layer's recompute buffer against the activations it
    saves on every block in flight)."""
    least, last = cand.but(recompute=problem.policies[0]), len(sizes) - 1
    bound = _bound(problem, least, sizes[last])  # first without memory: often enough
    if bound <= problem.reach(result) and _monotonic(cand):
        last = _largest_fitting(problem, cand.but(recompute=problem.policies[-1]), sizes, 0)
        if last < 0:
            return False  # nothing fits: the sweep says by how much
        bound = _bound(problem, least, sizes[last])
    if bound <= problem.reach(result):
        return False
    _out_of_reach(problem, least, result, len(problem.policies) * len(sizes), bound)
    return True


def _monotonic(cand: Candidate) -> bool:
    """Whether peak memory never shrinks as the microbatch grows: everywhere except where
    ZeRO-2/3's accumulated gradient arrives chunk by chunk under interleaving
    (``memory.peak_moment``: fewer, larger microbatches can reach the peak with fewer
    chunks' gradients)."""
    return not (cand.zero >= 2 and cand.schedule == "interleaved" and cand.pp > 1)


def _states_fit(problem: Problem, cand: Candidate, count: int, result: SearchResult) -> bool:
    """Whether parameters, gradients and optimizer states alone fit (any microbatch)."""
    probe = cand.but(micro_batch=1, microbatches=1, recompute="full")
    states = rank_states(problem.model, problem.training, probe, problem.paratrain)
    limit = problem.cluster.memory_limit
    if states <= limit:
        return True
    result.reject("model states exceed memory", cand.describe().rsplit(" mb", 1)[0],
                  f"parameters+gradients+optimizer need {states / GiB:.2f} GiB of "
                  f"{limit / GiB:.2f} GiB usable", count=count, overflow=states - limit)
    return False


def _memory(problem: Problem, cand: Candidate, mb: int) -> Memory:
    trial = _trial(cand, mb, problem.training.global_batch // cand.dp // mb)
    return rank_memory(problem.model, problem.training, trial, problem.paratrain)


def _largest_fitting(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int) -> int:
    """The index of the largest of ``sizes[first:]`` that fits (``first`` - 1 if none),
    by bisection: memory never shrinks with the size here (``_monotonic``)."""
    lo, hi, limit = first, len(sizes) - 1, problem.cluster.memory_limit
    while lo <= hi:
        mid = (lo + hi) // 2
        if _memory(problem, cand, sizes[mid]).total <= limit:
            lo = mid + 1
        else:
            hi = mid - 1
    return hi


def _first_in_reach(problem: Problem, cand: Candidate, sizes: tuple[int, ...], lo: int,
                    hi: int, result: SearchResult) -> int:
    """The index of the smallest of ``sizes[lo:hi + 1]`` whose bound is within reach
    (``hi`` + 1 if none), by bisection: the bound at a size holds for every smaller one,
    so it never grows with the size."""
    reach = problem.reach(result)
    if _bound(problem, cand, sizes[hi]) > reach:  # the common case: none is
        return hi + 1
    hi -= 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if _bound(problem, cand, sizes[mid]) <= reach:
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def _skip_out_of_reach(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                       result: SearchResult, fitted: set) -> tuple[int, int | None]:
    """(the first size to time, or the index to return at once) under the bound: sizes
    below the first whose bound is within reach are tallied, not timed. Where memory is
    monotonic the largest fitting size bounds them all (and the ones that fit are marked
    in ``fitted`` as the sweep would); past it only the first overflow is evaluated."""
    monotonic, last = _monotonic(cand), len(sizes) - 1
    hi = _largest_fitting(problem, cand, sizes, first) if monotonic else last
    if hi < first:
        return first, None  # nothing fits: the sweep says by how much
    lo = _first_in_reach(problem, cand, sizes, first, hi, result)
    if lo > first:
        _out_of_reach(problem, cand, result, lo - first, _bound(problem, cand, sizes[lo - 1]))
        if monotonic:
            fitted.update((cand.recompute, mb) for mb in sizes[first:lo])
    if monotonic and lo > hi:  # every size that fits is out of reach
        if hi < last:
            memory, limit = _memory(problem, cand, sizes[hi + 1]), problem.cluster.memory_limit
            result.reject("activations exceed memory", _trial(cand, sizes[hi + 1], 1).describe(),
                          lambda: _overflow_text(memory, problem.cluster),
                          count=last - hi, overflow=memory.total - limit)
        return lo, hi + 1
    return lo, None


def _sweep_microbatch(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                      result: SearchResult, skip: set, fitted: set) -> int:
    """Evaluate ``cand`` at ``sizes[first:]`` (ascending) until one overflows; returns the
    index of the first size that did not fit. Where memory is not monotonic in the size
    (``_monotonic``) every size is evaluated. Adds the sizes that fit, or are in
    ``skip``, to ``fitted``; a size that fitted with less recompute is not timed again."""
    training, cluster = problem.training, problem.cluster
    per_replica = training.global_batch // cand.dp
    monotonic, start = _monotonic(cand), first
    if problem.within and first < len(sizes):
        start, done = _skip_out_of_reach(problem, cand, sizes, first, result, fitted)
        if done is not None:
            return done
    overflowed = len(sizes)
    for i in range(start, len(sizes)):
        mb = sizes[i]
        if (cand.recompute, mb) in skip or any(size == mb for _, size in fitted):
            result.dominated += 1
            fitted.add((cand.recompute, mb))
            continue
        if per_replica % mb:
            # ``cand`` holds a placeholder micro batch (1x1): show the size that was tried.
            result.reject("micro batch does not divide the per-replica batch",
                          f"{cand.describe().rsplit(' mb', 1)[0]} mb{mb} rc={cand.recompute}",
                          f"{per_replica} sequences per replica % {mb} != 0")
            return len(sizes)
        m = per_replica // mb
        trial = _trial(cand, mb, m)
        if trial.schedule == "interleaved" and not _holds(rules.interleaved_microbatches, m, trial.pp):
            result.reject("interleaved needs microbatches divisible by pp", trial.describe(),
                          lambda m=m, p=trial.pp: f"{m} microbatches % pp={p} != 0 (Megatron's rule)")
            continue
        if trial.schedule == "dualpipev" and m < 2 * trial.pp:
            result.reject("dualpipev needs 2 x pp microbatches", trial.describe(),
                          lambda m=m, p=trial.pp: f"{m} microbatches < 2 x pp = {2 * p}")
            continue
        memory = rank_memory(problem.model, training, trial, problem.paratrain)
        if memory.total > cluster.memory_limit:
            result.reject("activations exceed memory", trial.describe(),
                          lambda memory=memory: _overflow_text(memory, cluster),
                          count=len(sizes) - i if monotonic else 1,
                          overflow=memory.total - cluster.memory_limit)
            if monotonic:
                return i
            overflowed = min(overflowed, i)
            continue
        fitted.add((cand.recompute, mb))
        if problem.refuse and (why := problem.refuse[1](trial)):
            result.reject(f"{problem.refuse[0]} cannot run it", trial.describe(), why)
            continue
        times = step_time(problem.model, training, cluster, trial)
        peak = cluster.gpu.peak_flops if training.precision == "bf16" else \
            cluster.gpu.peak_flops_fp32
        result.add(Plan(trial, memory, times, training.tokens / times.step,
                        problem.model_flops / (times.step * cluster.n_gpus * peak)))
    return overflowed


def _holds(rule, *args) -> bool:
    """Whether ``rules.<rule>(*args)`` accepts (the search tallies refusals in its own words)."""
    try:
        rule(*args)
    except LayoutError:
        return False
    return True


def _overflow_text(memory: Memory, cluster: Cluster) -> str:
    return (f"needs {memory.total / GiB:.2f} GiB of {cluster.memory_limit / GiB:.2f} GiB "
            f"usable (states {memory.states / GiB:.1f}, activations "
            f"{memory.activations / GiB:.1f}, buffers {memory.buffers / GiB:.1f}); "
            f"larger microbatches need more")
