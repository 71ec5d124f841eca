"""Time one candidate (a layout, schedule and ZeRO stage) at every microbatch size and
recompute policy that fits; with ``Problem.within``, first leave out what the lower bounds
of ``plan.bound`` show cannot come within that factor of the fastest plan so far."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from .. import rules
from ..layout import LayoutError
from .candidate import Candidate, Training
from .cost import step_time, zero_terms_time
from .hardware import GiB, Cluster
from .bound import Floor, at_size, step_bound
from .memory import Memory, rank_memory, rank_states
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
    zero: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages searched."""
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
        return ((self.micro_batch,) if self.micro_batch
                else divisors(self.training.global_batch // cand.dp))


@lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _out_of_reach(problem: Problem, cand: Candidate, result: SearchResult, count: int,
                  bound: float) -> None:
    result.reject(f"cannot come within {problem.within:g}x of the fastest",
                  cand.describe().rsplit(" mb", 1)[0],
                  lambda: f"at least {bound:.3g} s a step, the fastest {result.fastest:.3g} s",
                  count=count)


def sweep(problem: Problem, cand: Candidate, result: SearchResult,
          skip: set[tuple[str, int]], sizes: tuple[int, ...] | None = None,
          family: dict[str, float] | None = None) -> set[tuple[str, int]]:
    """Every microbatch size and recompute policy of ``cand``. A policy is tried only on
    the microbatches where less recompute did not fit: where it fits, less recompute is
    at least as fast (same everything, less compute). (policy, microbatch) pairs in
    ``skip`` fit with a lower ZeRO stage and are not timed; returns the pairs that fit
    or were skipped. ``sizes``: the microbatch sizes to try (``problem.sizes``);
    ``family``: ``family_reach``'s bounds of its layout and schedule, per policy."""
    sizes = sizes or problem.sizes(cand)
    fitted: set[tuple[str, int]] = set()
    if not _states_fit(problem, cand, len(problem.policies) * len(sizes), result):
        return fitted
    live = _live_policies(problem, cand, sizes, result, family or {}) if problem.within else None
    first = 0
    for policy in problem.policies:
        if live is not None and policy not in live:  # every size of it is out of reach
            _out_of_reach(problem, cand.but(recompute=policy), result, len(sizes) - first,
                          min((b for b, _ in live.values()), default=result.reach))
            continue
        result.dominated += first
        first = _sweep_microbatch(problem, cand.but(recompute=policy), sizes, first, result,
                                  skip, fitted, live[policy][1] if live else len(sizes))
    return fitted


def _live_policies(problem: Problem, cand: Candidate, sizes: tuple[int, ...],
                   result: SearchResult, family: dict[str, float]) -> dict[str, tuple[float, int]]:
    """The recompute policies of ``cand`` with a plan that may come within reach: their
    bound and how many of ``sizes`` may fit. First, cheaply, ``family`` plus this ZeRO
    stage's terms at their least (the largest size, and the most recompute's longer
    backward to hide them behind); then each policy at the largest size its memory floor
    (``Floor`` at ``cand``'s ZeRO stage) fits. paratrain's own runtime counts memory its
    own way: every size, at the least recompute's bound."""
    reach, policies = result.reach, problem.policies
    if problem.paratrain:
        bound = step_bound(problem, cand.but(recompute=policies[0]), sizes[-1])
        return dict.fromkeys(policies, (bound, len(sizes))) if bound <= reach else {}
    most = at_size(cand.but(recompute=policies[-1]), sizes[-1],
                   problem.training.global_batch // cand.dp // sizes[-1])
    extra = zero_terms_time(problem.model, problem.training, problem.cluster, most)
    memory, live = Floor(problem, cand, (cand.zero,)), {}
    for policy in policies:
        if family.get(policy, 0.0) + extra > reach:
            continue
        n = memory.count_fitting(policy, sizes)
        if n and (bound := step_bound(problem, cand.but(recompute=policy), sizes[n - 1])) <= reach:
            live[policy] = bound, n
    return live


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
    return rank_memory(problem.model, problem.training,
                       at_size(cand, mb, problem.training.global_batch // cand.dp // mb),
                       problem.paratrain)


def _largest_fitting(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                     last: int | None = None) -> int:
    """The index of the largest of ``sizes[first:last + 1]`` that fits (``first`` - 1 if
    none), by bisection: memory never shrinks with the size here (``_monotonic``)."""
    lo, hi, limit = first, len(sizes) - 1 if last is None else last, problem.cluster.memory_limit
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
    reach = result.reach
    if step_bound(problem, cand, sizes[hi]) > reach:  # the common case: none is
        return hi + 1
    hi -= 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if step_bound(problem, cand, sizes[mid]) <= reach:
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def _skip_out_of_reach(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                       result: SearchResult, fitted: set, top: int) -> tuple[int, int | None]:
    """(the first size to time, or the index to return at once) under the bound: sizes
    below the first whose bound is within reach are tallied, not timed. Where memory is
    monotonic the largest fitting size bounds them all (and the ones that fit are marked
    in ``fitted`` as the sweep would); past it only the first overflow is evaluated.
    ``sizes[top + 1:]`` are over the memory floor: none of them fits."""
    monotonic, last = _monotonic(cand), len(sizes) - 1
    hi = _largest_fitting(problem, cand, sizes, first, top) if monotonic else top
    if hi < first:
        return first, None  # nothing fits: the sweep says by how much
    lo = _first_in_reach(problem, cand, sizes, first, hi, result)
    if lo > first:
        _out_of_reach(problem, cand, result, lo - first, step_bound(problem, cand, sizes[lo - 1]))
        if monotonic:
            fitted.update((cand.recompute, mb) for mb in sizes[first:lo])
    if monotonic and lo > hi:  # every size that fits is out of reach
        if hi < last:
            memory, limit = _memory(problem, cand, sizes[hi + 1]), problem.cluster.memory_limit
            result.reject("activations exceed memory", at_size(cand, sizes[hi + 1], 1).describe(),
                          lambda: _overflow_text(memory, problem.cluster),
                          count=last - hi, overflow=memory.total - limit)
        return lo, hi + 1
    return lo, None


def _sweep_microbatch(problem: Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                      result: SearchResult, skip: set, fitted: set, fits: int | None = None) -> int:
    """Evaluate ``cand`` at ``sizes[first:]`` (ascending) until one overflows; returns the
    index of the first size that did not fit. Where memory is not monotonic in the size
    (``_monotonic``) every size is evaluated. Adds the sizes that fit, or are in
    ``skip``, to ``fitted``; a size that fitted with less recompute is not timed again.
    ``fits``: how many sizes may fit at all (over the memory floor past them)."""
    training, cluster = problem.training, problem.cluster
    per_replica = training.global_batch // cand.dp
    monotonic, start, fits = _monotonic(cand), first, len(sizes) if fits is None else fits
    if problem.within and first < len(sizes):
        start, done = _skip_out_of_reach(problem, cand, sizes, first, result, fitted, fits - 1)
        if done is not None:
            return done
    overflowed = len(sizes) if monotonic else fits
    for i in range(start, len(sizes) if monotonic else fits):
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
        trial = at_size(cand, mb, m)
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
