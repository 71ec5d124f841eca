"""Evaluate one given layout (``paratrain plan --layout``, ``--compare``): its full
breakdown even when it does not fit, why not and by how much, and where it would rank.

A layout spec fixes any subset of the choices, written as the tables print them:
``dp8 tp8 pp4 cp1 v2 zero1 mb1 recompute=selective`` (also ``z1``, ``tp8+sp``, ``tp8-sp``,
``rc=sel``, ``mb1x16``, ``gpipe`` / ``1f1b`` / ``interleaved`` / ``interleaved/v2``,
``ring`` / ``ulysses`` or ``cp2/ulysses`` for context parallelism's attention, ``ep2``
for a mixture of experts' expert parallelism,
``reshard=yes|no`` or ``z3/reshard`` / ``z3/keep`` for ZeRO-3's gathered parameters).
What it leaves out is searched: the best completion that fits is shown, or, when none
fits, the one closest to fitting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .. import rules
from ..parallel.pipeline.zero_bubble import V_SHAPED
from .candidate import RECOMPUTE, Candidate, Training
from .cost import StepTime, step_time
from .flops import step_flops
from .hardware import Cluster
from .memory import Memory, rank_memory
from .models import ModelSpec
from .completion import candidates
from .results import SearchResult, rank_key
from .search import layout_problems
from .sweep import divisors
from .sweep import _holds

_SIZE = re.compile(r"(dp|tp|pp|cp|ep)(\d+)([+-]sp)?(?:/(ring|ulysses))?")
_ALIASES = {"sel": "selective", "no": "none", "off": "none"}


@dataclass(frozen=True)
class LayoutSpec:
    """The choices a ``--layout`` string fixes; None means searched."""

    dp: int | None = None
    """Data-parallel replicas."""
    tp: int | None = None
    """Tensor-parallel ranks."""
    pp: int | None = None
    """Pipeline stages."""
    cp: int | None = None
    """Context-parallel ranks."""
    ep: int | None = None
    """Expert-parallel ranks of a mixture of experts (folded onto dp x cp: not a factor of
    the world)."""
    zero: int | None = None
    """ZeRO stage."""
    micro_batch: int | None = None
    """Sequences per microbatch."""
    microbatches: int | None = None
    """Microbatches per step (only checked: the batch sets it)."""
    schedule: str | None = None
    """``gpipe``, ``1f1b``, ``interleaved``, or the zero-bubble ``zbh1``, ``zbv`` and
    ``dualpipev`` (named only: the search times them)."""
    virtual_stages: int | None = None
    """Chunks per pipeline rank."""
    recompute: str | None = None
    """``none``, ``selective`` or ``full``."""
    shard_group: int | None = None
    """HSDP shard group (``hsdp8``, ``z3/hsdp8``)."""
    cp_method: str | None = None
    """Context parallelism's attention: ``ring`` or ``ulysses``."""
    reshard_after_forward: bool | None = None
    """ZeRO-3 (``reshard=yes|no``, or ``z3/reshard``, ``z3/keep``): regather every
    microbatch, or keep the units gathered through the step (default: paratrain's auto)."""
    sequence_parallel: bool | None = None
    """``tp8+sp``: sequence parallelism asked for; ``tp8-sp``: plain tensor parallelism
    (None: as the search, SP wherever the sequence splits over tp, plain TP elsewhere)."""
    text: str = ""
    """The string it was parsed from."""


def parse_layout(text: str) -> LayoutSpec:
    """``LayoutSpec`` of a ``--layout`` string; ValueError naming the token otherwise."""
    values: dict = {"text": text.strip()}
    given: dict[str, str] = {}  # field -> the token that set it
    for token in text.replace(",", " ").split():
        for key, value in _read_token(token).items():
            # 'tp2 tp4' or 'z1 reshard=yes' must not quietly become the last one written;
            # the same value twice ('z3 hsdp8' both say ZeRO-3) is no contradiction.
            if key in values and values[key] != value:
                raise ValueError(f"--layout {text.strip()!r}: {_FIELD_NAMES.get(key, key)} "
                                 f"given twice ({given[key]}, then {token}); give each "
                                 f"choice once")
            values[key], given[key] = value, token
    spec = LayoutSpec(**values)
    v = spec.virtual_stages or 1
    if v > 1 and spec.schedule not in (None, "interleaved", *V_SHAPED):
        raise ValueError(f"--layout {text!r}: v{v} needs the interleaved schedule")
    if spec.schedule in V_SHAPED and v != 2 and spec.virtual_stages is not None:
        raise ValueError(f"--layout {text!r}: {spec.schedule} runs two chunks per rank "
                         f"(v2), not v{v}")
    return spec


_FIELD_NAMES = {"zero": "the ZeRO stage", "micro_batch": "the microbatch size (mb)",
                "microbatches": "the microbatch count (mbNxM)", "virtual_stages": "v",
                "recompute": "recompute", "cp_method": "cp's attention (ring/ulysses)",
                "shard_group": "the HSDP group", "reshard_after_forward": "reshard"}
"""How a ``LayoutSpec`` field is named in a --layout error; dp/tp/pp/cp name themselves."""


def _read_token(token: str) -> dict:
    """The ``LayoutSpec`` fields one --layout token sets; ValueError naming it otherwise."""
    low, values = token.lower(), {}
    if m := _SIZE.fullmatch(low):
        values[m.group(1)] = int(m.group(2))
        if m.group(3) and m.group(1) != "tp":
            raise ValueError(f"--layout {token!r}: {m.group(3)} (sequence parallelism on or "
                             f"off) goes with tp, e.g. tp8+sp or tp8-sp")
        if m.group(3):
            values["sequence_parallel"] = m.group(3) == "+sp"
        if m.group(4) and m.group(1) != "cp":
            raise ValueError(f"--layout {token!r}: /{m.group(4)} is context parallelism's "
                             f"attention, e.g. cp2/{m.group(4)}")
        if m.group(4):
            values["cp_method"] = m.group(4)
    elif low in ("ring", "ulysses"):
        values["cp_method"] = low
    elif m := re.fullmatch(r"(?:zero|z)([0-3])(?:/hsdp(\d+))?(?:/(reshard|keep))?", low):
        values["zero"] = int(m.group(1))
        if m.group(2):
            values["shard_group"] = int(m.group(2))
        if m.group(3) and values["zero"] != 3:
            raise ValueError(f"--layout {token!r}: /{m.group(3)} is a ZeRO-3 choice")
        if m.group(3):
            values["reshard_after_forward"] = m.group(3) == "reshard"
    elif m := re.fullmatch(r"reshard=(yes|no)", low):
        values["zero"], values["reshard_after_forward"] = 3, m.group(1) == "yes"
    elif m := re.fullmatch(r"hsdp(\d+)", low):
        values["zero"], values["shard_group"] = 3, int(m.group(1))
    elif m := re.fullmatch(r"mb(\d+)(?:x(\d+))?", low):
        values["micro_batch"] = int(m.group(1))
        if m.group(2):
            values["microbatches"] = int(m.group(2))
    elif m := re.fullmatch(r"v(\d+)", low):
        values["virtual_stages"] = int(m.group(1))
    elif m := re.fullmatch(r"(gpipe|1f1b|interleaved|zbh1|zbv|dualpipev)(?:/v(\d+))?", low):
        values["schedule"] = m.group(1)
        if m.group(2):
            values["virtual_stages"] = int(m.group(2))
    elif m := re.fullmatch(r"(?:recompute|rc)=(\w+)", low):
        policy = _ALIASES.get(m.group(1), m.group(1))
        if policy not in RECOMPUTE:
            raise ValueError(f"--layout {token!r}: recompute is one of {', '.join(RECOMPUTE)}")
        values["recompute"] = policy
    else:
        raise ValueError(f"--layout: cannot read {token!r}; write e.g. 'dp8 tp8 pp4 cp1 v2 "
                         f"zero1 mb1 1f1b recompute=selective' (any subset)")
    if any(values.get(k) == 0 for k in ("dp", "tp", "pp", "cp", "ep", "micro_batch",
                                         "microbatches", "virtual_stages")):
        raise ValueError(f"--layout {token!r}: sizes must be positive")
    return values


@dataclass
class Evaluation:
    """One layout's predictions and what stops it."""

    cand: Candidate
    """The layout with its searched choices filled in."""
    memory: Memory | None
    """Peak bytes on the worst rank (None if the layout cannot be costed at all)."""
    time: StepTime | None
    """Seconds per step by component."""
    problems: list[str] = field(default_factory=list)
    """Why the layout is rejected; empty when it is valid and fits."""
    overflow: float = 0.0
    """Bytes over the usable memory (0 when it fits)."""
    rank: int | None = None
    """Position among the search's ranked plans by step time (1 = would win)."""
    ranked: int = 0
    """Plans the search ranked."""
    unranked: str = ""
    """Why it has no rank though it was costed ('' when ranked)."""
    tokens_per_s: float = 0.0
    """Throughput of the whole job."""
    mfu: float = 0.0
    """Model FLOPs per second over the peak of all GPUs."""

    @property
    def fits(self) -> bool:
        return not self.problems


def evaluate_candidate(model: ModelSpec, training: Training, cluster: Cluster,
                       cand: Candidate, paratrain: bool | None = None) -> Evaluation:
    """Predictions for ``cand`` whether or not it is valid or fits."""
    paratrain = cluster.kind == "local" if paratrain is None else paratrain
    problems = layout_problems(model, training, cluster, cand)
    try:
        memory = rank_memory(model, training, cand, paratrain)
        times = step_time(model, training, cluster, cand)
    except (ZeroDivisionError, ValueError, IndexError) as err:
        # A broken rule is often why costing fails: say the same thing once.
        costing = [] if str(err) in problems else [f"cannot be costed: {err}"]
        return Evaluation(cand, None, None, problems + costing)
    overflow = max(0.0, memory.total - cluster.memory_limit)
    if overflow:
        problems.append(f"does not fit: needs {_gib(memory.total)} of "
                        f"{_gib(cluster.memory_limit)} usable, {_gib(overflow)} over "
                        f"(states {_gib(memory.states)}, activations "
                        f"{_gib(memory.activations)}, buffers {_gib(memory.buffers)})")
    peak = cluster.gpu.peak_flops if training.precision == "bf16" else cluster.gpu.peak_flops_fp32
    return Evaluation(cand, memory, times, problems, overflow,
                      tokens_per_s=training.tokens / times.step,
                      mfu=step_flops(model, training) / (times.step * cluster.n_gpus * peak))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _closeness(ev: Evaluation) -> tuple:
    """Best first: fitting, in the ranking's order (``rank_key``: fastest at three
    significant figures, then least memory); else fewest problems, least overflow, fastest."""
    step = ev.time.step if ev.time else float("inf")
    if ev.fits:
        return (0, 0, 0.0, *rank_key(step, ev.memory.total))
    structural = sum(not p.startswith("does not fit") for p in ev.problems)
    return (1, structural, ev.overflow, step, 0.0)


def evaluate(spec: LayoutSpec, model: ModelSpec, training: Training, cluster: Cluster,
             result: SearchResult) -> Evaluation:
    """The best completion of ``spec`` (or the closest to fitting), ranked against
    ``result``, the search over all layouts."""
    best = None
    timed = sorted(result.plans + result.shadowed,
                   key=lambda p: rank_key(p.time.step, p.memory.total))
    # the search's fastest completion (a bounded search timed every plan within its reach
    # only): no need to enumerate them all
    searched = next((plan.cand for plan in timed if _completes(spec, plan.cand)
                     and plan.time.step <= result.reach), None)
    if searched is not None:
        best = evaluate_candidate(model, training, cluster, searched)
    for cand in () if searched is not None else candidates(spec, model, training, cluster):
        ev = evaluate_candidate(model, training, cluster, cand)
        if best is None or _closeness(ev) < _closeness(best):
            best = ev
    if best is None:
        raise ValueError(f"--layout {spec.text!r} has no layout on {cluster.n_gpus} ranks")
    if spec.microbatches is not None and spec.microbatches != best.cand.microbatches:
        best.problems.insert(0, f"mb{best.cand.micro_batch}x{spec.microbatches}: the global "
                                f"batch gives {best.cand.microbatches} microbatches")
    best.ranked = len(result.plans)
    c, batch = best.cand, training.global_batch
    if best.time is None:
        best.unranked = "it cannot be costed"
    elif not _holds(rules.batch, batch, c.dp, c.micro_batch):
        # costed at the sequences it can run, which are not the batch the others run
        ran = c.dp * c.micro_batch * c.microbatches
        best.unranked = (f"costed at {ran} sequences per step (dp{c.dp} x mb{c.micro_batch} x "
                         f"{c.microbatches}), not {batch}; --global-batch "
                         f"{' or '.join(map(str, _runnable_batches(batch, c.dp * c.micro_batch)))}"
                         f" runs it")
    elif not result.plans:
        best.unranked = "no layout fits, so there is nothing to rank against"
    elif best.time.step > result.reach:
        best.unranked = (f"{best.time.step / result.fastest:.2f}x the fastest step, and only "
                         f"plans within {result.within:g}x are ranked (--within); drop --within "
                         f"to rank every plan")
    else:
        key = rank_key(best.time.step, best.memory.total)
        best.rank = 1 + sum(rank_key(p.time.step, p.memory.total) < key for p in result.plans)
    return best


_SEARCHED = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "schedule", "virtual_stages",
             "recompute", "cp_method")
"""Spec fields a search plan can be matched on; a spec fixing any other choice (HSDP,
reshard, +sp, the microbatch count) is completed by enumeration."""


def _completes(spec: LayoutSpec, cand: Candidate) -> bool:
    """Whether ``cand`` (a search plan: it fits) is a completion of ``spec``."""
    if (spec.shard_group, spec.reshard_after_forward, spec.sequence_parallel,
            spec.microbatches) != (None, None, None, None):
        return False
    return all(getattr(spec, name) in (None, getattr(cand, name)) for name in _SEARCHED)


def _runnable_batches(batch: int, unit: int) -> list[int]:
    """The multiples of ``unit`` just below and above ``batch``."""
    below = batch // unit * unit
    return [b for b in (below, below + unit) if b > 0]


def with_search(spec_texts: list[str], model: ModelSpec, training: Training,
                cluster: Cluster, result: SearchResult, micro_batch: int | None = None,
                recompute: str | None = None) -> list[Evaluation]:
    """Evaluate each ``--layout`` / ``--compare`` string; ``--micro-batch`` and
    ``--recompute`` fix those choices for each layout, as they do for the search."""
    return [evaluate(_with_flags(parse_layout(t), micro_batch, recompute), model, training,
                     cluster, result) for t in spec_texts]


def _with_flags(spec: LayoutSpec, micro_batch: int | None, recompute: str | None) -> LayoutSpec:
    for name, flag, value in (("micro_batch", "--micro-batch", micro_batch),
                              ("recompute", "--recompute", recompute)):
        mine = getattr(spec, name)
        if value is not None and mine is not None and mine != value:
            raise ValueError(f"--layout {spec.text!r} gives {_FIELD_NAMES[name]} {mine}, and "
                             f"{flag} {value}; give it once")
        if value is not None:
            spec = replace(spec, **{name: value})
    return spec



def nearest_batches(model: ModelSpec, training: Training, cluster: Cluster,
                    micro_batch: int | None = None, recompute: str | None = None,
                    count: int = 3, tries: int = 12) -> list[int]:
    """Global batches near ``training.global_batch`` for which some layout fits, nearest
    first (up to ``count``, from at most ``tries`` searches): the multiples of each
    possible data-parallel size (and of the fixed microbatch) just below and above."""
    from .search import search

    wanted = training.global_batch
    near = {b for dp in divisors(cluster.n_gpus)
            for b in _runnable_batches(wanted, dp * (micro_batch or 1)) if b != wanted}
    found = []
    for batch in sorted(near, key=lambda b: (abs(b - wanted), b))[:tries]:
        if search(model, replace(training, global_batch=batch), cluster,
                  micro_batch=micro_batch, recompute=recompute).plans:
            found.append(batch)
            if len(found) == count:
                break
    return found
