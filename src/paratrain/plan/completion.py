"""Every completion of a partly given layout (``--layout "dp8 tp4"``): the choices the
search makes, enumerated without pruning, for ``plan.evaluate`` to cost and pick from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import rules
from ..layout import Layout
from ..parallel.pipeline.zero_bubble import V_SHAPED
from .candidate import RECOMPUTE, SCHEDULES, Candidate, Training
from .hardware import Cluster
from .models import ModelSpec
from .search import _hsdp_groups, _virtual_stages
from .sweep import Problem, divisors

if TYPE_CHECKING:
    from .evaluate import LayoutSpec


def _options(fixed, choices):
    return (fixed,) if fixed is not None else tuple(choices)


def candidates(spec: LayoutSpec, model: ModelSpec, training: Training,
               cluster: Cluster):
    """Every completion of ``spec`` on ``cluster`` (no pruning: invalid ones included)."""
    n = cluster.n_gpus
    named = [getattr(spec, a) for a in ("dp", "tp", "pp", "cp") if getattr(spec, a)]
    product = 1
    for size in named:
        product *= size
    if n % product or (len(named) == 4 and product != n):
        sizes = " x ".join(f"{a}{getattr(spec, a)}" for a in ("dp", "tp", "pp", "cp") if getattr(spec, a))
        need = f"{product} ranks" if len(named) == 4 else f"a multiple of {product} ranks"
        raise ValueError(f"--layout {spec.text!r}: {sizes} needs {need}; the cluster has {n}")
    # A schedule or v means a pipeline, Ulysses context parallelism: never complete them
    # with pp1 or cp1, where the choice would silently mean nothing.
    piped = (spec.schedule in ("gpipe", "interleaved", "zbh1", *V_SHAPED)
             or (spec.virtual_stages or 1) > 1)
    _needs_more_than_one(spec, "pp", piped, "a pipeline schedule or v")
    _needs_more_than_one(spec, "cp", spec.cp_method == "ulysses", "ulysses")
    if (spec.ep or 1) > 1 and not model.n_experts:
        raise ValueError(f"--layout {spec.text!r}: ep{spec.ep} splits a mixture of experts' "
                         f"experts, and {model.name} has none")
    for tp in _options(spec.tp, divisors(n)):
        for cp in _options(spec.cp, divisors(n // tp) if n % tp == 0 else ()):
            for pp in _options(spec.pp, divisors(n // (tp * cp)) if n % (tp * cp) == 0 else ()):
                if n % (tp * cp * pp) or (piped and pp == 1) or (
                        spec.cp_method == "ulysses" and cp == 1):
                    continue
                dp = n // (tp * cp * pp)
                if spec.dp is not None and spec.dp != dp:
                    continue
                for cand in _choices(spec, model, training, dp, tp, pp, cp):
                    yield cand
                    yield from _zero3_choices(spec, model, training, cluster, cand)


def _needs_more_than_one(spec: LayoutSpec, axis: str, needed: bool, what: str) -> None:
    if needed and getattr(spec, axis) == 1:
        raise ValueError(f"--layout {spec.text!r}: {what} needs {axis} > 1, and {axis}1 is "
                         f"given; raise {axis} or drop {what}")


def _choices(spec, model, training, dp, tp, pp, cp):
    per_replica = max(training.global_batch // dp, 1)
    # as the search: SP wherever the tokens split over tp, else plain TP; asked for (+sp),
    # SP is kept, and the rules report it where it cannot run
    sp = (rules.sequence_parallel_splits(tp, cp, training.seq_len)
          if spec.sequence_parallel is None else spec.sequence_parallel)
    schedules = ("1f1b",) if pp == 1 and spec.schedule is None else _options(
        spec.schedule, SCHEDULES if (spec.virtual_stages or 1) == 1 else ("interleaved",))
    for schedule in schedules:
        vs = (2,) if schedule in V_SHAPED else (1,) if schedule != "interleaved" else _options(
            spec.virtual_stages, _virtual_stages(model.n_layers, pp) or [2])
        for v in vs:
            for zero in _options(spec.zero, (0, 1, 2, 3) if dp * cp > 1 else (0,)):
                for mb in _options(spec.micro_batch, divisors(per_replica)):
                    for rc in _options(spec.recompute, RECOMPUTE):
                        for method in _options(spec.cp_method, ("ring", "ulysses") if cp > 1 else ("ring",)):
                            for layout in _expert_layouts(spec, model, dp, tp, pp, cp):
                                yield Candidate(layout, zero, mb, max(per_replica // mb, 1),
                                                schedule, v, rc, sp,
                                                shard_group=spec.shard_group or 0, cp_method=method,
                                                reshard_after_forward=spec.reshard_after_forward)


def _zero3_choices(spec: LayoutSpec, model: ModelSpec, training: Training, cluster: Cluster,
                   cand: Candidate):
    """ZeRO-3's other choices the search times beside ``cand`` where the spec leaves them
    open: the other gather rule (``reshard_after_forward``) and HSDP over one node's
    dp x cp ranks (``search._hsdp_groups``), so that enumeration completes a layout among
    the same choices as the search."""
    if cand.zero != 3 or cand.shard == 1:
        return
    if spec.reshard_after_forward is None:
        yield cand.but(reshard_after_forward=cand.pp > 1)
    if spec.shard_group is None:
        problem = Problem(model, training, cluster, None, RECOMPUTE, 0.0,
                          hsdp=cluster.kind != "local")
        for group in _hsdp_groups(problem, cand):
            yield cand.but(shard_group=group)


def _expert_layouts(spec: LayoutSpec, model: ModelSpec, dp: int, tp: int, pp: int, cp: int):
    """The layout with each expert-parallel degree of the spec (or, unnamed, of a mixture
    of experts: those dividing n_experts); those that do not divide dp x cp, where ep is
    folded, have no layout."""
    eps = (spec.ep,) if spec.ep else (divisors(model.n_experts) if model.n_experts else (1,))
    for ep in eps:
        if (dp * cp) % ep == 0:
            yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
