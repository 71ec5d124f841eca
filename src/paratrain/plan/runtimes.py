"""The trainers a plan can be written for (``paratrain plan --runtime``), and what each
can express.

One ``Runtime`` per trainer, in ``RUNTIMES``: the ZeRO stages, pipeline schedules,
context-parallel methods, tensor-parallel modes, expert parallelism and recompute
policies its own configuration can ask for. ``refusal`` says why a candidate is not one
of them; ``nearest`` finds the best-ranked plan that is. ``--runtime`` makes the search
propose only what the trainer runs (``search_options``, then ``restrict``), times it at
the trainer's measured speed (``speed``: ``plan/speed.py``), names both in the output and
picks the ``--emit`` format.
"""

from __future__ import annotations

from dataclasses import dataclass

from .candidate import Candidate, Training
from .models import ModelSpec
from .results import Plan, SearchResult, rank_key
from ..parallel.pipeline.zero_bubble import KINDS as ZERO_BUBBLE
from .speed import FUSED, Speed, profile


@dataclass(frozen=True)
class Runtime:
    """What one trainer's configuration can express, with where each fact comes from."""

    name: str
    """The ``--runtime`` value."""
    title: str
    """The trainer and the version its config format is written for."""
    emits: str
    """What ``--emit`` writes for it."""
    zero: tuple[int, ...]
    """ZeRO stages it shards with (0: plain data parallelism)."""
    zero_with_pp: tuple[int, ...]
    """ZeRO stages it allows under pipeline parallelism."""
    schedules: tuple[str, ...]
    """Pipeline schedules (``gpipe``, ``1f1b``, ``interleaved``)."""
    cp_methods: tuple[str, ...]
    """Context parallelism's attention (``ring``, ``ulysses``); empty: none."""
    tp_modes: tuple[str, ...]
    """Tensor parallelism: ``sp`` (with Megatron sequence parallelism) and/or ``plain``;
    empty: none."""
    expert_parallel: bool
    """Expert parallelism for a mixture of experts can be set in its config."""
    recompute: tuple[str, ...]
    """Recompute policies its config can ask for (``selective`` is the attention core's,
    as Megatron and paratrain recompute it)."""
    uneven_stages: bool
    """Pipeline stages with unequal block counts (paratrain's balanced split)."""
    hsdp: bool
    """Hybrid sharding (ZeRO-3 within groups, replicas across them)."""
    tp_with_pp: bool = True
    """Tensor and pipeline parallelism together."""
    replicate_1d_only: bool = False
    """Plain data parallelism (ZeRO-0) only when it is the one parallel axis."""
    rank_order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    """Its axes from fastest- to slowest-varying rank: Megatron's ``tp-cp-ep-dp-pp``,
    torchtitan's mesh ``[pp, dp_replicate, dp_shard, cp, tp]`` and DeepSpeed's pipe-outermost
    topology all put pp outermost (paratrain: pp inside dp)."""
    source: str = ""
    """Where the facts above were read."""

    def line(self, speed: Speed) -> str:
        """The runtime and the speed it is timed at, as the plan's output names them."""
        where = (f"; calibrated on {speed.calibrated}" if speed.calibrated and not speed.fused
                 else "")
        if speed is FUSED and self.name in ("paratrain", "torchtitan"):
            where = " (the local cluster's calibration measures paratrain's own step)"
        elif speed is FUSED and self.name == "deepspeed":
            where = " (no published DeepSpeed run calibrates a profile: an optimistic bound)"
        return f"runtime: {self.title}, timed as {speed.name}{where}"


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (
    Runtime("paratrain", "paratrain train", "a train config (--out's TOML)",
            zero=(0, 1, 2, 3), zero_with_pp=(0, 1, 2, 3),
            schedules=("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"),
            cp_methods=("ring", "ulysses"),
            tp_modes=("sp", "plain"), expert_parallel=True,
            recompute=("none", "selective", "full"), uneven_stages=True, hsdp=False,
            rank_order=("tp", "cp", "pp", "dp"), source="train's own rules (plan/export.refusal)"),
    Runtime("torchtitan", "torchtitan 0.2 (JobConfig TOML)", "a job TOML for --job.config_file",
            zero=(0, 3), zero_with_pp=(3,), schedules=("gpipe", "1f1b", "interleaved"),
            cp_methods=("ring",), tp_modes=("sp",), expert_parallel=True,
            recompute=("none", "full"), uneven_stages=True, hsdp=True,
            replicate_1d_only=True,
            source="torchtitan 0.2.2: config/job_config.py (Parallelism, ActivationCheckpoint), "
                   "models/llama3/infra/parallelize.py (FSDP2 over dp_shard x cp; DDP only "
                   "as the sole axis; TP always with SequenceParallel norms; op-level "
                   "selective AC saves attention), distributed/pipeline_parallel.py"),
    Runtime("megatron", "Megatron-LM / megatron-core", "Megatron-LM's command-line arguments",
            zero=(0, 1), zero_with_pp=(0, 1), schedules=("1f1b", "interleaved"),
            cp_methods=("ring", "ulysses"), tp_modes=("sp", "plain"), expert_parallel=True,
            recompute=("none", "selective", "full"), uneven_stages=True, hsdp=False,
            source="megatron-core ModelParallelConfig / TransformerConfig (cp_comm_type p2p "
                   "is ring, a2a is Ulysses); Megatron-LM arguments.py "
                   "(--use-distributed-optimizer is ZeRO-1; --decoder-first/last-pipeline-"
                   "num-layers for uneven ends); ZeRO-2/3 are Megatron-FSDP, not emitted"),
    Runtime("deepspeed", "DeepSpeed", "a DeepSpeed JSON config",
            zero=(0, 1, 2, 3), zero_with_pp=(0, 1), schedules=("1f1b",),
            cp_methods=("ulysses",), tp_modes=("plain",), expert_parallel=False,
            recompute=("none", "full"), uneven_stages=True, hsdp=False, tp_with_pp=False,
            source="DeepSpeed 0.19: runtime/config.py (zero_optimization, pipeline, "
                   "sequence_parallel_size, tensor_parallel.autotp_size), runtime/pipe/engine.py "
                   "(ZeRO-2/3 refused with a pipeline; one schedule, 1F1B: TrainSchedule); "
                   "AutoTP splits linears without sequence parallelism; MoE's ep_size is an "
                   "argument of deepspeed.moe.layer.MoE in the model code, not the config"),
)}
"""Every runtime ``--runtime`` accepts, by name."""

DEFAULT_RUNTIME = "paratrain"


def refusal(runtime: Runtime, cand: Candidate, model: ModelSpec, training: Training) -> str | None:
    """Why ``runtime``'s configuration cannot express ``cand``, or None."""
    if runtime.name == "paratrain":  # train's own rules, one place (plan/export.py)
        from .export import refusal as train_refusal
        return train_refusal(cand, model, training)
    for check in (_sharding, _pipeline, _tensor, _context, _experts, _recompute):
        why = check(runtime, cand, model)
        if why:
            return f"{runtime.title} cannot express {cand.describe()}: {why}"
    return None


def _sharding(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.shard == 1:  # nothing to shard or replicate: every stage is the same run
        return None
    if cand.zero not in rt.zero:
        return (f"ZeRO-{cand.zero} is not one of its stages "
                f"({', '.join(f'ZeRO-{z}' for z in rt.zero)})")
    if cand.hsdp and not rt.hsdp:
        return "hybrid sharding (HSDP) is not in its config"
    if cand.pp > 1 and cand.zero not in rt.zero_with_pp:
        return f"ZeRO-{cand.zero} is refused under pipeline parallelism"
    if rt.name == "deepspeed" and cand.zero == 3 and not cand.reshards:
        return "its ZeRO-3 gathers parameters again for backward; keeping them through the step is not a setting"
    if rt.replicate_1d_only and cand.zero == 0 and (cand.tp > 1 or cand.pp > 1 or cand.cp > 1):
        return ("plain data parallelism (DDP) runs only as the sole parallel axis; with tp, "
                "pp or cp it shards with FSDP (ZeRO-3)")
    return None


def _pipeline(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.pp == 1:
        return None
    schedule = ("interleaved" if cand.virtual_stages > 1 and cand.schedule == "1f1b"
                else cand.schedule)
    if schedule not in rt.schedules:
        return f"the {schedule} pipeline schedule is not one of its ({', '.join(rt.schedules)})"
    if not rt.uneven_stages and model.n_layers % (cand.pp * cand.virtual_stages):
        return f"{model.n_layers} layers do not split evenly over {cand.pp * cand.virtual_stages} stages"
    if rt.name == "megatron":
        return _megatron_stages(cand, model)
    return None


def _megatron_stages(cand: Candidate, model: ModelSpec) -> str | None:
    """Megatron cuts stages evenly, or with a first and a last stage of their own size
    (--decoder-first/last-pipeline-num-layers) and no interleaving."""
    sizes = [len(r) for r in model.stage_runs(cand.pp, cand.virtual_stages)]
    if len(set(sizes)) == 1:
        return None
    if cand.virtual_stages > 1:
        return (f"an uneven interleaved split ({'-'.join(map(str, sizes))} layers per chunk) "
                f"is not emitted; choose a v that divides the layers per stage")
    if min(sizes) == 0 or len(set(sizes[1:-1])) > 1:
        return (f"the split {'-'.join(map(str, sizes))} has more than a first and a last stage "
                f"of their own size")
    return None


def _tensor(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.tp == 1:
        return None
    mode = "sp" if cand.sp else "plain"
    if mode not in rt.tp_modes:
        if not rt.tp_modes:
            return "it has no tensor parallelism"
        return (f"tensor parallelism {'with' if cand.sp else 'without'} sequence parallelism "
                f"is not what it runs ({' or '.join(rt.tp_modes)} only)")
    if cand.pp > 1 and not rt.tp_with_pp:
        return "tensor parallelism together with a pipeline is not in its config"
    if rt.name == "deepspeed" and cand.zero == 3:
        return "AutoTP tensor parallelism runs with ZeRO 0-2, not ZeRO-3"
    return None


def _context(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.cp == 1:
        return None
    if cand.cp_method not in rt.cp_methods:
        have = ", ".join(rt.cp_methods) or "none"
        return f"{cand.cp_method} context parallelism is not among its methods ({have})"
    if rt.name == "deepspeed" and cand.pp > 1:
        return "Ulysses together with its pipeline engine is not in its config"
    return None


def _experts(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.ep > 1 and not rt.expert_parallel:
        return "expert parallelism is not set in its config (the model code sets it)"
    return None


def _recompute(rt: Runtime, cand: Candidate, model: ModelSpec) -> str | None:
    if cand.recompute not in rt.recompute:
        return (f"{cand.recompute} recompute (of the attention core) is not one of its "
                f"policies ({', '.join(rt.recompute)})")
    return None


def nearest(runtime: Runtime, result: SearchResult, model: ModelSpec, training: Training,
            like: Candidate | None = None) -> Plan | None:
    """The plan ``runtime`` can express that is closest to ``like`` (fewest differing
    choices, then rank), or the best-ranked one it can express; None if no ranked or
    shadowed plan is one."""
    pool = sorted(result.plans + result.shadowed,
                  key=lambda p: rank_key(p.time.step, p.memory.total))
    runnable = [p for p in pool if not refusal(runtime, p.cand, model, training)]
    if not runnable or like is None:
        return runnable[0] if runnable else None
    return min(runnable, key=lambda p: _distance(p.cand, like))


_COMPARED = ("dp", "tp", "pp", "cp", "ep", "zero", "schedule", "virtual_stages", "cp_method",
             "recompute", "micro_batch")
"""The choices ``nearest`` counts differences in, most significant first."""


def _distance(cand: Candidate, like: Candidate) -> int:
    return sum(getattr(cand, name) != getattr(like, name) for name in _COMPARED)


def speed(runtime: str, eager: bool, cluster_kind: str) -> Speed:
    """What ``runtime`` is timed at: its measured profile on GPUs (compiled unless
    ``eager``); on the local cluster the fused model, whose constants ``--calibrate``
    measured on paratrain's own eager step."""
    if cluster_kind == "local":
        return FUSED
    return profile(runtime, compiled=not eager)


def search_options(runtime: Runtime) -> dict:
    """``search``'s switches for what ``runtime`` can run; ``restrict`` removes the rest."""
    if runtime.name == DEFAULT_RUNTIME:
        return {}
    return dict(zero=runtime.zero, context_parallel=bool(runtime.cp_methods),
                sequence_parallel="sp" in runtime.tp_modes,
                ulysses="ulysses" in runtime.cp_methods, hsdp=runtime.hsdp,
                uneven_stages=runtime.uneven_stages,
                zero_bubble=bool(set(runtime.schedules) & set(ZERO_BUBBLE)))


def refuser(runtime: Runtime, model: ModelSpec, training: Training):
    """``search``'s ``refuse`` for what ``runtime`` cannot run (None: paratrain's own
    runtime, whose rules the search already holds)."""
    if runtime.name == DEFAULT_RUNTIME:
        return None
    return runtime.name, lambda cand: refusal(runtime, cand, model, training)


def restrict(result: SearchResult, runtime: Runtime, model: ModelSpec,
             training: Training) -> SearchResult:
    """``result`` with the plans ``runtime`` cannot express moved to its rejections."""
    if runtime.name == DEFAULT_RUNTIME:  # the search already holds train's own rules
        return result
    kept = []
    for plan in result.plans:
        why = refusal(runtime, plan.cand, model, training)
        if why:
            result.reject(f"{runtime.name} cannot run it", plan.cand.describe(), why)
        else:
            kept.append(plan)
    result.plans = kept
    return result
