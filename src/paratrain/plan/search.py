"""Enumerate every valid layout of a model on a cluster, drop what does not fit, rank by
predicted step time.

The space is (tp, cp, pp, dp) with tp·cp·pp·dp = GPUs, then the schedule (1F1B or
interleaved with v chunks), ZeRO stage, recompute policy and microbatch size. Validity is
``rules.check_split`` (heads, KV heads, MLP width, layers, sequence) plus batch divisibility. The
search prunes what cannot win, so a 405B model on 16,384 GPUs takes about a second:

* tp stays inside a node: its collectives sit on the critical path of every block, and
  over the network they cost several times the compute they serve;
* GPipe is not timed: it has 1F1B's bubble and communication and more activations;
* sequence parallelism is always on with tp > 1 (same communication, less memory);
* a (shape, ZeRO stage) whose parameters, gradients and optimizer states alone overflow
  is rejected once for all its microbatches and recompute policies;
* peak memory never shrinks as the microbatch grows, so the first microbatch size that
  overflows rejects the larger ones too (except ZeRO-2/3 under interleaving, whose
  accumulated gradient arrives chunk by chunk: there every size is tried);
* more recompute is tried only at microbatch sizes where less recompute overflowed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import lru_cache

from .. import rules
from ..layout import Layout, LayoutError
from .candidate import RECOMPUTE, Candidate, Training
from .cost import step_time
from .flops import step_flops
from .hardware import GiB, Cluster, members_per_node
from .memory import Memory, rank_memory, rank_states
from .models import ModelSpec
from .results import Plan, SearchResult, rank_key


@lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class _Problem:
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

    @property
    def paratrain(self) -> bool:
        """Count memory as paratrain's own runtime holds it (processes on this machine
        run paratrain), not by the published formulas."""
        return self.cluster.kind == "local"


def search(model: ModelSpec, training: Training, cluster: Cluster,
           micro_batch: int | None = None, recompute: str | None = None,
           zero: tuple[int, ...] = (0, 1, 2, 3), context_parallel: bool = True,
           sequence_parallel: bool = True, hsdp: bool = True,
           uneven_stages: bool = True, ulysses: bool = True,
           zero_bubble: bool = True) -> SearchResult:
    """Every valid layout of ``model`` on ``cluster``, ranked by predicted step time.
    ``micro_batch`` / ``recompute`` fix those choices instead of searching them; ``zero``
    lists the ZeRO stages to consider; ``context_parallel``, ``sequence_parallel``,
    ``hsdp``, ``uneven_stages``, ``ulysses`` and ``zero_bubble`` False leave those out (what a given
    framework cannot run). HSDP is never
    searched on the local cluster: ``train`` does not run it."""
    start = time.perf_counter()
    result = SearchResult(plans=[])
    problem = _Problem(model, training, cluster, micro_batch,
                       (recompute,) if recompute else RECOMPUTE, step_flops(model, training),
                       context_parallel, sequence_parallel,
                       hsdp and cluster.kind != "local" and 3 in zero, uneven_stages, ulysses,
                       zero_bubble)
    for shape in _cp_methods(problem, _expert_splits(problem, _shapes(problem, result), result),
                             result):
        for cand in _schedules(problem, shape, result):
            first = len(result.plans)
            fitted: set = set()
            # Every stage is timed: ZeRO-2/3 send more than the stage below but can hide
            # more of it (ZeRO-3 gathers each unit behind the previous one's compute,
            # where ZeRO-1/2's gather of the updated parameters waits after the step).
            for stage in _zero_stages(problem, cand, zero, result):
                fitted = _sweep(problem, cand.but(zero=stage), result, set())
            if 3 in zero and cand.shard > 1 and _experts_allow(problem, cand.but(zero=3)):
                # ZeRO-3's other choice: under a pipeline, regathering every microbatch
                # (less memory, more traffic and the same overlap: only where keeping did
                # not fit); without one, keeping the units gathered (more memory, fewer
                # gathers).
                other = cand.but(zero=3, reshard_after_forward=cand.pp > 1)
                _sweep(problem, other, result, fitted if cand.pp > 1 else set())
            for group in _hsdp_groups(problem, cand) if 3 in zero and _experts_allow(
                    problem, cand.but(zero=3)) else ():
                _sweep(problem, cand.but(zero=3, shard_group=group), result, set())
            _drop_dominated(result, first)
    result.plans.sort(key=lambda p: rank_key(p.time.step, p.memory.total))
    result.seconds = time.perf_counter() - start
    return result


def _expert_splits(problem: _Problem, shapes, result: SearchResult):
    """Each shape with every expert-parallel degree of a mixture of experts: ep dividing
    n_experts and dp x cp (where ep is folded), kept where ``rules.check_split`` (its
    ``rules.experts``) accepts it, as train does; a dense model's shapes as they are."""
    for shape in shapes:
        experts = problem.model.n_experts
        if not experts:
            yield shape
            continue
        for ep in divisors(experts):
            if shape.shard % ep == 0 and (ep == 1 or _valid(
                    problem, split := shape.but(layout=replace(shape.layout, ep=ep)), 1,
                    f"{shape.describe().rsplit(' z', 1)[0]} ep{ep}", result)):
                yield shape if ep == 1 else split


def _zero_stages(problem: _Problem, cand: Candidate, zero: tuple[int, ...],
                 result: SearchResult) -> list[int]:
    """The ZeRO stages to time for ``cand``: every one asked for with dp x cp > 1 (0
    otherwise), less those ``rules.expert_strategies`` refuses for a mixture of experts."""
    return [z for z in (zero if cand.shard > 1 else (0,)) if _experts_allow(problem, cand.but(zero=z), result)]


def _experts_allow(problem: _Problem, cand: Candidate, result: SearchResult | None = None) -> bool:
    """Whether ``train`` runs a mixture of experts with ``cand``'s strategies
    (``rules.expert_strategies``: its ZeRO stage with its ep); a refusal is tallied."""
    try:
        rules.expert_strategies(problem.model.n_experts, cand.ep, cand.zero, "none")
    except LayoutError as err:
        if result is not None:
            result.reject(str(err).split(":")[0], cand.describe().rsplit(" mb", 1)[0], str(err))
        return False
    return True


def _drop_dominated(result: SearchResult, first: int) -> None:
    """Move aside the plans of one shape (``result.plans[first:]``) that a lower ZeRO stage
    at the same microbatch and recompute matches in both step time and memory (ZeRO-2
    under a pipeline: ZeRO-1's traffic, and the accumulated gradient besides the sharded
    one): they add rows, not choices. ``--layout`` still completes to them."""
    plans = result.plans[first:]

    def dominated(p: Plan) -> bool:
        return any(q.cand.zero < p.cand.zero and (q.cand.micro_batch, q.cand.recompute)
                   == (p.cand.micro_batch, p.cand.recompute)
                   and q.time.step <= p.time.step and q.memory.total <= p.memory.total
                   for q in plans)

    aside = [p for p in plans if dominated(p)]
    result.dominated += len(aside)
    result.shadowed += aside
    result.plans[first:] = [p for p in plans if not dominated(p)]


def _hsdp_groups(problem: _Problem, cand: Candidate, most: int = 1) -> list[int]:
    """HSDP shard groups worth timing for ``cand``: one node's dp x cp ranks (FSDP's
    HYBRID_SHARD), then ``most`` - 1 doublings (two, four nodes), while smaller than the
    whole dp x cp span. One by default: each group is a full sweep, and the search has a
    time budget (tests/test_plan_search.py)."""
    if not problem.hsdp:
        return []
    n = cand.shard
    g = members_per_node(cand.sizes(), problem.training.rank_order, ("cp", "dp"),
                         problem.cluster.node_size)
    groups = []
    while 1 < g < n and n % g == 0 and len(groups) < most:  # a group of 1 shards nothing
        groups.append(g)
        g *= 2
    return groups


def layout_problems(model: ModelSpec, training: Training, cluster: Cluster,
                    cand: Candidate) -> list[str]:
    """Every rule ``cand`` breaks, short of memory (the rules the search prunes by)."""
    problems = []
    if cand.tp > cluster.node_size:
        problems.append(f"tp={cand.tp} spans nodes of {cluster.node_size} GPUs: tensor "
                        f"parallelism is kept inside a node")
    if cand.shard_group and (cand.zero != 3 or cand.shard % cand.shard_group):
        problems.append(f"hsdp{cand.shard_group}: hybrid sharding needs zero3 and a group "
                        f"dividing dp x cp = {cand.shard}")
    elif cand.hsdp and cluster.kind == "local":
        problems.append(f"hsdp{cand.shard_group}: hybrid sharding is planned for GPU clusters "
                        f"only; paratrain's runtime (--cluster local) does not run it")
    try:
        rules.batch(training.global_batch, cand.dp, cand.micro_batch)
    except LayoutError as err:
        problems.append(str(err))
    try:
        _check_model(model, training.seq_len, cand, cand.virtual_stages)
    except LayoutError as err:
        problems.append(str(err))
    if cand.schedule == "interleaved":
        try:
            rules.interleaved_microbatches(cand.microbatches, cand.pp)
        except LayoutError as err:
            problems.append(str(err))
    try:
        rules.expert_strategies(model.n_experts, cand.ep, cand.zero, "none")
    except LayoutError as err:
        problems.append(str(err))
    return problems


def _shapes(problem: _Problem, result: SearchResult):
    """(tp, cp, pp, dp) splits of the world that pass ``rules.check_split``."""
    n, node = problem.cluster.n_gpus, problem.cluster.node_size
    batch = problem.training.global_batch
    for tp in divisors(n):
        for cp in divisors(n // tp) if problem.context_parallel else (1,):
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                # SP cuts each rank's tokens over tp: where they do not divide, plain TP
                sp = problem.sequence_parallel and rules.sequence_parallel_splits(
                    tp, cp, problem.training.seq_len)
                shape = Candidate(Layout(dp=dp, tp=tp, pp=pp, cp=cp), 0, 1, 1, sequence_parallel=sp)
                label = f"dp{dp} tp{tp} pp{pp} cp{cp}"
                if tp > node:
                    result.reject(f"tp={tp} spans nodes of {node} GPUs", label,
                                  "tensor parallelism is kept inside a node")
                elif not _holds(rules.batch, batch, dp):
                    result.reject(f"dp={dp} does not divide the global batch", label,
                                  f"global batch {batch} % dp={dp} != 0")
                elif not problem.uneven_stages and problem.model.n_layers % pp:
                    result.reject(f"pp={pp} does not divide the layers (even stages only)",
                                  label, f"{problem.model.n_layers} layers % pp={pp} != 0")
                elif _valid(problem, shape, 1, label, result):
                    yield shape


def _cp_methods(problem: _Problem, shapes, result: SearchResult):
    """Each shape with ring attention, and with Ulysses too where cp > 1 and its heads
    split over cp."""
    for shape in shapes:
        yield shape
        if shape.cp > 1 and problem.ulysses:
            uly = shape.but(cp_method="ulysses")
            if _valid(problem, uly, 1, uly.describe().rsplit(" z", 1)[0], result):
                yield uly


def _valid(problem: _Problem, cand: Candidate, v: int, label: str,
           result: SearchResult) -> bool:
    try:
        _check_model(problem.model, problem.training.seq_len, cand, v)
    except LayoutError as err:
        result.reject(str(err).split(";")[0], label, str(err))
        return False
    return True


def _holds(rule, *args) -> bool:
    """Whether ``rules.<rule>(*args)`` accepts (the search tallies refusals in its own words)."""
    try:
        rule(*args)
    except LayoutError:
        return False
    return True


def _check_model(model: ModelSpec, seq_len: int, cand: Candidate, v: int) -> None:
    """``rules.check_split`` and SP's split: the rules ``train`` and the strategies apply."""
    rules.check_split(model, cand.layout, virtual_stages=v, seq_len=seq_len,
                      cp_method=cand.cp_method)
    rules.sequence_parallel(cand.sp, cand.tp, cand.cp, seq_len)


def _schedules(problem: _Problem, shape: Candidate, result: SearchResult):
    """The shape with every pipeline schedule worth timing. GPipe is left out: it has
    1F1B's bubble and communication and holds more activations, so it never ranks above."""
    if shape.pp == 1:
        yield shape
        return
    yield replace(shape, schedule="1f1b")
    for kind, v in (("zbh1", 1), ("zbv", 2), ("dualpipev", 2)) if problem.zero_bubble else ():
        cand = replace(shape, schedule=kind, virtual_stages=v)
        if v == 2 and problem.model.tie_embeddings:  # the V puts both ends on rank 0
            result.reject("tied embeddings need a loop placement", cand.describe(),
                          f"{kind} holds the embedding and the head on one rank")
        elif v == 1 or _valid(problem, cand, v, cand.describe(), result):
            yield cand
    for v in _virtual_stages(problem.model.n_layers, shape.pp, problem.uneven_stages):
        cand = replace(shape, schedule="interleaved", virtual_stages=v)
        if _valid(problem, cand, v, cand.describe(), result):
            yield cand


def _virtual_stages(n_layers: int, pp: int, uneven: bool = True) -> list[int]:
    """Chunks per rank worth searching: those that give every chunk the same blocks, and
    (``uneven``: software that splits stages unevenly) one block per chunk with the
    embedding and the head as chunks of their own (Llama 3's v8 for 126 layers on 16
    ranks) where that count exists."""
    vs = set(divisors(n_layers // pp)[1:])
    ends = -(-(n_layers + 1) // pp)  # the fewest chunks per rank past one per block
    if uneven and ends > 1 and pp * ends <= n_layers + 2:
        vs.add(ends)
    return sorted(vs)


def _sweep(problem: _Problem, cand: Candidate, result: SearchResult,
           skip: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Every microbatch size and recompute policy of ``cand``. A policy is tried only on
    the microbatches where less recompute did not fit: where it fits, less recompute is
    at least as fast (same everything, less compute). (policy, microbatch) pairs in
    ``skip`` fit with a lower ZeRO stage and are not timed; returns the pairs that fit
    or were skipped."""
    sizes = ((problem.micro_batch,) if problem.micro_batch
             else divisors(problem.training.global_batch // cand.dp))
    fitted: set[tuple[str, int]] = set()
    if not _states_fit(problem, cand, len(problem.policies) * len(sizes), result):
        return fitted
    first = 0
    for policy in problem.policies:
        result.dominated += first
        first = _sweep_microbatch(problem, cand.but(recompute=policy), sizes, first, result,
                                  skip, fitted)
    return fitted


def _states_fit(problem: _Problem, cand: Candidate, count: int, result: SearchResult) -> bool:
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


def _sweep_microbatch(problem: _Problem, cand: Candidate, sizes: tuple[int, ...], first: int,
                      result: SearchResult, skip: set, fitted: set) -> int:
    """Evaluate ``cand`` at ``sizes[first:]`` (ascending) until one overflows; returns the
    index of the first size that did not fit. Peak memory never shrinks with the size,
    except where ZeRO-2/3's accumulated gradient arrives chunk by chunk under interleaving
    (``memory.peak_moment``: fewer, larger microbatches can reach the peak with fewer
    chunks' gradients), so there every size is evaluated. Adds the sizes that fit, or are
    in ``skip``, to ``fitted``; a size that fitted with less recompute is not timed again."""
    training, cluster = problem.training, problem.cluster
    per_replica = training.global_batch // cand.dp
    monotonic = not (cand.zero >= 2 and cand.schedule == "interleaved" and cand.pp > 1)
    overflowed = len(sizes)
    for i in range(first, len(sizes)):
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
        trial = Candidate(cand.layout, cand.zero, mb, m, cand.schedule,
                          cand.virtual_stages, cand.recompute, cand.sequence_parallel,
                          cand.shard_group, cand.cp_method, cand.reshard_after_forward)
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
        times = step_time(problem.model, training, cluster, trial)
        peak = cluster.gpu.peak_flops if training.precision == "bf16" else \
            cluster.gpu.peak_flops_fp32
        result.plans.append(Plan(trial, memory, times, training.tokens / times.step,
                                 problem.model_flops / (times.step * cluster.n_gpus * peak)))
    return overflowed


def _overflow_text(memory: Memory, cluster: Cluster) -> str:
    return (f"needs {memory.total / GiB:.2f} GiB of {cluster.memory_limit / GiB:.2f} GiB "
            f"usable (states {memory.states / GiB:.1f}, activations "
            f"{memory.activations / GiB:.1f}, buffers {memory.buffers / GiB:.1f}); "
            f"larger microbatches need more")
