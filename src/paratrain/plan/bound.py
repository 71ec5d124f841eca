"""Lower bounds on the step time of a search's candidates, which let it leave out what
cannot come within ``Problem.within`` of the fastest plan found so far (``plan.sweep``).

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
schedule. Where it is applied, cheapest first:

1. ``quick_bound``: a layout and schedule's compute and communication at its least
   recompute and largest size (no memory counted): the search orders candidates by it
   and stops at the first out of reach.
2. ``family_reach``: per recompute policy, at the largest size a memory floor
   (``_Floor``: the least states and fixed buffers over the ZeRO stages searched, plus
   activations) fits; the sizes past every policy's are not tried.
3. Per ZeRO stage (``sweep``): 2 plus that stage's data-parallel and optimizer terms at
   their least; then each policy at its own floor (``_live_policies``); then, for those
   left, the largest size that fits by bisection on the real memory, and the smallest
   size within reach by bisection on the bound (``_skip_out_of_reach``).

More recompute only adds time and never adds memory (one layer's recompute buffer
against the activations it saves on every block in flight). ``tests/test_plan_bound.py``
checks the bounds against every plan of full searches, and that a bounded search ranks
the same plans within its factor as the full one.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from . import moe
from ..parallel.pipeline.zero_bubble import V_SHAPED
from .candidate import Candidate, Training
from .cost import time_without_bubble
from .memory import (_state_bytes, inflight_microbatches, layer_activation_bytes,
                     zero_buffer_bytes)
from .models import ModelSpec

if TYPE_CHECKING:
    from .sweep import Problem


def quick_bound(problem: Problem, cand: Candidate) -> float:
    """A lower bound on the step time of every plan of ``cand``'s layout and schedule, from
    one evaluation: the least recompute at the largest size, compute and communication
    alone (looser than ``family_reach``, which counts memory)."""
    return compute_bound(problem, cand.but(recompute=problem.policies[0]), problem.sizes(cand)[-1])


def family_reach(problem: Problem, cand: Candidate) -> tuple[dict[str, float], tuple[int, ...]]:
    """(a lower bound per recompute policy on the step time of every plan of ``cand``'s
    layout and schedule, the microbatch sizes at which one may fit), at any ZeRO stage:
    for each policy, the largest size whose memory floor (``Floor``) fits bounds the
    sizes below it, at its compute and communication alone, without the bubble and the
    data-parallel and optimizer terms (``_bound``'s, less those that depend on the ZeRO
    stage); infinite where no size fits. paratrain's own runtime (the local cluster)
    counts memory its own way: every size, each policy bounded by the least recompute."""
    sizes = problem.sizes(cand)
    if problem.paratrain:
        bound = compute_bound(problem, cand.but(recompute=problem.policies[0]), sizes[-1])
        return dict.fromkeys(problem.policies, bound), sizes
    floor = Floor(problem, cand)
    bounds, fits = {}, 0
    for policy in problem.policies:
        n = floor.count_fitting(policy, sizes)
        bounds[policy] = compute_bound(problem, cand.but(recompute=policy), sizes[n - 1]) \
            if n else float("inf")
        fits = max(fits, n)
    return bounds, sizes[:fits]


class Floor:
    """A lower bound on the peak bytes of a layout and schedule at any ZeRO stage the
    search tries (or ``zeros``): per stage, the least of each ZeRO stage's states and the buffers it
    holds whatever the microbatch (ZeRO-1/2's staging; ZeRO-2's accumulated gradient under
    a pipeline, at least one chunk's; ZeRO-3's gathered units, the fewer of kept and
    regathered), plus what grows with the microbatch: the activations (a MoE block's
    routed ones too) of the fewest microbatches the schedule holds at its peak (one for a
    V short of 2 x pp microbatches, whose tables vary), the layer being recomputed, and
    the last stage's logits."""

    def __init__(self, problem: Problem, cand: Candidate,
                 zeros: tuple[int, ...] | None = None) -> None:
        self.problem, self.cand = problem, cand
        model, p, v = problem.model, cand.pp, cand.virtual_stages
        self.stages = sorted({0, p - 1})
        self.fixed = {s: min(_held(problem.model, problem.training, cand.layout, v,
                                   cand.shard_group, z, s)
                             for z in zeros or problem.zero) for s in self.stages}
        self.layers = {s: model.stage_layers(p, s, v) for s in self.stages}
        self.moe_layers = {s: model.stage_moe_layers(p, s, v) for s in self.stages}

    def bytes(self, policy: str, mb: int) -> float:
        """The floor at recompute ``policy`` and microbatch size ``mb``."""
        problem, cand = self.problem, self.cand
        model, training = problem.model, problem.training
        s_len, p, v = training.seq_len // cand.cp, cand.pp, cand.virtual_stages
        m = training.global_batch // cand.dp // mb
        per_layer = layer_activation_bytes(model, s_len, mb, cand.tp, cand.sp, policy,
                                           training.act_bytes, training.flash_attention)
        short_v = cand.schedule in V_SHAPED and m < 2 * p
        logits = s_len * mb * model.vocab_size / cand.tp * (training.act_bytes + 4)
        # the layer being recomputed, briefly in full (memory._buffers)
        rerun = 0.0 if policy == "none" else layer_activation_bytes(
            model, s_len, mb, cand.tp, cand.sp, "none", training.act_bytes,
            training.flash_attention) - per_layer
        experts = 0.0  # a MoE block's routed activations beyond a dense block's, either sign
        if model.n_experts:
            tokens = s_len * mb // (cand.tp if cand.sp else 1)
            experts = moe.activation_delta(model, tokens, cand.tp, training.act_bytes,
                                           moe.load_factor(training, cand.ep))

        def stage(s: int) -> float:
            alive = 1.0 if short_v else inflight_microbatches(cand.schedule, p, m, v, s)
            held = per_layer * self.layers[s]
            if self.moe_layers[s]:  # full recompute keeps the block input only, and reruns one
                held += 0.0 if policy == "full" else self.moe_layers[s] * experts
                rerun_experts = min(experts, 0.0) if policy == "full" else 0.0
            else:
                rerun_experts = 0.0
            return (self.fixed[s] + alive * held + rerun + rerun_experts
                    + (logits if s == p - 1 else 0.0))

        return max(stage(s) for s in self.stages)

    def count_fitting(self, policy: str, sizes: tuple[int, ...]) -> int:
        """How many of ``sizes`` (ascending) the floor fits, by bisection: it never
        shrinks with the size."""
        lo, hi, limit = 0, len(sizes) - 1, self.problem.cluster.memory_limit
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.bytes(policy, sizes[mid]) <= limit:
                lo = mid + 1
            else:
                hi = mid - 1
        return lo


@lru_cache(maxsize=1 << 16)
def _held(model: ModelSpec, training: Training, layout, v: int, shard_group: int | None,
          zero: int, stage: int) -> float:
    """``Floor``'s bytes of ``stage`` at ZeRO ``zero`` that do not grow with the
    microbatch (keyed by what they depend on: the search asks once per candidate)."""
    cand = Candidate(layout, zero, 1, 1, "interleaved" if v > 1 else "1f1b", v,
                     shard_group=shard_group)
    zero = zero if cand.shard > 1 else 0
    states = sum(_state_bytes(model, training, cand.but(zero=zero), stage))
    # the least over ZeRO-3's reshard choices and over the accumulated gradient's share
    return states + min(zero_buffer_bytes(model, training, cand.but(reshard_after_forward=r),
                                          stage, zero, 1 / v) for r in (True, False))


def compute_bound(problem: Problem, cand: Candidate, mb: int) -> float:
    """``step_bound`` less the terms that depend on the ZeRO stage (data-parallel and
    optimizer): a bound for ``cand``'s layout and schedule at any ZeRO stage."""
    return _time(problem, cand, mb, zero_terms=False)


def step_bound(problem: Problem, cand: Candidate, mb: int) -> float:
    """A lower bound on the step time of ``cand`` at any microbatch size up to ``mb``."""
    return _time(problem, cand, mb)


def _time(problem: Problem, cand: Candidate, mb: int, zero_terms: bool = True) -> float:
    return time_without_bubble(problem.model, problem.training, problem.cluster,
                               at_size(cand, mb, problem.training.global_batch // cand.dp // mb),
                               zero_terms)


def at_size(cand: Candidate, mb: int, m: int) -> Candidate:
    """``cand`` at microbatch size ``mb`` and ``m`` microbatches."""
    return Candidate(cand.layout, cand.zero, mb, m, cand.schedule, cand.virtual_stages,
                     cand.recompute, cand.sequence_parallel, cand.shard_group, cand.cp_method,
                     cand.reshard_after_forward)
