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

import heapq
import time
from dataclasses import replace
from typing import Callable

from .. import rules
from ..layout import Layout, LayoutError
from .candidate import RECOMPUTE, Candidate, Training
from .flops import step_flops
from .hardware import GiB, Cluster, members_per_node
from .models import ModelSpec
from .results import Plan, SearchResult, rank_key
from .bound import Floor, family_reach, quick_bound
from .sweep import Problem, _holds, divisors, sweep


def search(model: ModelSpec, training: Training, cluster: Cluster,
           micro_batch: int | None = None, recompute: str | None = None,
           zero: tuple[int, ...] = (0, 1, 2, 3), context_parallel: bool = True,
           sequence_parallel: bool = True, hsdp: bool = True,
           uneven_stages: bool = True, ulysses: bool = True,
           zero_bubble: bool = True, within: float | None = None,
           refuse: tuple[str, Callable[[Candidate], str | None]] | None = None) -> SearchResult:
    """Every valid layout of ``model`` on ``cluster``, ranked by predicted step time.
    ``micro_batch`` / ``recompute`` fix those choices instead of searching them; ``zero``
    lists the ZeRO stages to consider; ``context_parallel``, ``sequence_parallel``,
    ``hsdp``, ``uneven_stages``, ``ulysses`` and ``zero_bubble`` False leave those out
    (what a given framework cannot run). HSDP is never searched on the local cluster:
    ``train`` does not run it. ``within`` (a factor >= 1) ranks only the plans within it of
    the fastest, skipping what ``plan.bound``'s bounds show cannot come that close: the
    same plans in that range as the full search, in a fraction of its time. ``refuse``:
    (a trainer's name, why it cannot run a candidate or None), tallied instead of ranked
    (``runtimes.refuser``; what ``runtimes.restrict`` does after a full search)."""
    if within is not None and within < 1:
        raise ValueError(f"within={within}: a factor of the fastest step time, at least 1")
    start = time.perf_counter()
    result = SearchResult(plans=[], within=within)
    problem = Problem(model, training, cluster, micro_batch,
                      (recompute,) if recompute else RECOMPUTE, step_flops(model, training),
                      context_parallel, sequence_parallel,
                      hsdp and cluster.kind != "local" and 3 in zero, uneven_stages, ulysses,
                      zero_bubble, zero, within, refuse)
    for cand, sizes, family in _candidates(problem, result):
        first = len(result.plans)
        fitted: set = set()
        # Every stage is timed: ZeRO-2/3 send more than the stage below but can hide
        # more of it (ZeRO-3 gathers each unit behind the previous one's compute,
        # where ZeRO-1/2's gather of the updated parameters waits after the step).
        for stage in _zero_stages(problem, cand, zero, result):
            fitted = sweep(problem, cand.but(zero=stage), result, set(), sizes, family)
        if 3 in zero and cand.shard > 1 and _experts_allow(problem, cand.but(zero=3)):
            # ZeRO-3's other choice: under a pipeline, regathering every microbatch
            # (less memory, more traffic and the same overlap: only where keeping did
            # not fit); without one, keeping the units gathered (more memory, fewer
            # gathers).
            other = cand.but(zero=3, reshard_after_forward=cand.pp > 1)
            sweep(problem, other, result, fitted if cand.pp > 1 else set(), sizes, family)
        for group in _hsdp_groups(problem, cand) if 3 in zero and _experts_allow(
                problem, cand.but(zero=3)) else ():
            sweep(problem, cand.but(zero=3, shard_group=group), result, set(), sizes, family)
        _drop_dominated(result, first)
    result.plans.sort(key=lambda p: rank_key(p.time.step, p.memory.total))
    result.seconds = time.perf_counter() - start
    return result


def _candidates(problem: Problem, result: SearchResult):
    """Every valid layout with each of its schedules, the microbatch sizes to try, and
    lower bounds on its step time per recompute policy (None: no bound). With a bound
    (``problem.within``), best first by ``family_reach``'s bound (a memory floor per
    policy), so that the fastest plan is timed early and the bound skips the most; that
    bound is computed lazily, in the order of ``quick_bound`` (one evaluation, looser),
    only for candidates whose quick bound could still come first. Candidates past the
    first one out of reach are tallied together."""
    valid = (cand for shape in _cp_methods(problem, _expert_splits(
        problem, _shapes(problem, result), result), result)
        for cand in _schedules(problem, shape, result))
    if not problem.within:
        yield from ((cand, problem.sizes(cand), None) for cand in valid)
        return
    quick = sorted((quick_bound(problem, cand), i, cand) for i, cand in enumerate(valid))
    refined: list = []  # a heap of (family bound, order, candidate, sizes, bounds)
    at = 0
    while True:
        while at < len(quick) and (not refined or quick[at][0] < refined[0][0]):
            if quick[at][0] > result.reach:  # and so are the rest
                _beyond(problem, result, quick[at][2], quick[at][0], len(quick) - at)
                at = len(quick)
                break
            _refine(problem, result, quick[at][1], quick[at][2], refined)
            at += 1
        if not refined:
            return
        bound, _, cand, sizes, bounds = heapq.heappop(refined)
        if bound > result.reach:  # every other refined one too
            _beyond(problem, result, cand, bound, 1 + len(refined))
            refined = []
            continue
        yield cand, sizes, bounds


def _refine(problem: Problem, result: SearchResult, order: int, cand: Candidate,
            refined: list) -> None:
    """Push ``cand`` with its ``family_reach`` onto the heap ``refined``, or tally it
    where nothing fits."""
    bounds, sizes = family_reach(problem, cand)
    if sizes:
        heapq.heappush(refined, (min(bounds.values()), order, cand, sizes, bounds))
    else:  # by how much: the floor at its least, the most recompute and smallest size
        least = Floor(problem, cand).bytes(problem.policies[-1], problem.sizes(cand)[0])
        limit = problem.cluster.memory_limit
        result.reject("activations exceed memory at any ZeRO stage and recompute",
                      cand.describe().rsplit(" z", 1)[0],
                      f"at least {least / GiB:.2f} GiB of {limit / GiB:.2f} GiB usable at the "
                      f"smallest microbatch and the most recompute (the least states and "
                      f"buffers of any ZeRO stage, and activations)",
                      count=len(problem.sizes(cand)), overflow=least - limit)


def _beyond(problem: Problem, result: SearchResult, cand: Candidate, bound: float,
            count: int) -> None:
    result.reject(f"cannot come within {problem.within:g}x of the fastest",
                  cand.describe().rsplit(" z", 1)[0],
                  f"at least {bound:.3g} s a step at any ZeRO stage, recompute and microbatch, "
                  f"the fastest {result.fastest:.3g} s", count=count)


def _expert_splits(problem: Problem, shapes, result: SearchResult):
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


def _zero_stages(problem: Problem, cand: Candidate, zero: tuple[int, ...],
                 result: SearchResult) -> list[int]:
    """The ZeRO stages to time for ``cand``: every one asked for with dp x cp > 1 (0
    otherwise), less those ``rules.expert_strategies`` refuses for a mixture of experts."""
    return [z for z in (zero if cand.shard > 1 else (0,)) if _experts_allow(problem, cand.but(zero=z), result)]


def _experts_allow(problem: Problem, cand: Candidate, result: SearchResult | None = None) -> bool:
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


def _hsdp_groups(problem: Problem, cand: Candidate, most: int = 1) -> list[int]:
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


def _shapes(problem: Problem, result: SearchResult):
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


def _cp_methods(problem: Problem, shapes, result: SearchResult):
    """Each shape with ring attention, and with Ulysses too where cp > 1 and its heads
    split over cp."""
    for shape in shapes:
        yield shape
        if shape.cp > 1 and problem.ulysses:
            uly = shape.but(cp_method="ulysses")
            if _valid(problem, uly, 1, uly.describe().rsplit(" z", 1)[0], result):
                yield uly


def _valid(problem: Problem, cand: Candidate, v: int, label: str,
           result: SearchResult) -> bool:
    try:
        _check_model(problem.model, problem.training.seq_len, cand, v)
    except LayoutError as err:
        result.reject(str(err).split(";")[0], label, str(err))
        return False
    return True


def _check_model(model: ModelSpec, seq_len: int, cand: Candidate, v: int) -> None:
    """``rules.check_split`` and SP's split: the rules ``train`` and the strategies apply."""
    rules.check_split(model, cand.layout, virtual_stages=v, seq_len=seq_len,
                      cp_method=cand.cp_method)
    rules.sequence_parallel(cand.sp, cand.tp, cand.cp, seq_len)


def _schedules(problem: Problem, shape: Candidate, result: SearchResult):
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
