"""Turn a plain model into a parallel one, in a fixed order.

The order every strategy composes in:
TP/SP -> CP -> pipeline split -> activation checkpointing -> compilation (--compile) ->
ZeRO/DDP wrapping.
Impossible combinations are rejected up front by ``Config.validate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from .mesh import EDP, EMBEDDING, EP, REPLICA, SHARD, Mesh
from .models.description import describe
from .parallel.context import apply_context_parallel
from .parallel.data import DataParallel
from .parallel.balance import Balance
from .parallel.compile import compile_regions
from .parallel.engine import ReplicatedEngine
from .parallel.expert import apply_expert_parallel, split_sequences
from .parallel.local_update import LocalUpdateEngine
from .parallel.masters import cast_params
from .parallel.pipeline import split_model
from .parallel.pipeline import Recorder
from .parallel.pipeline.schedules import placement
from .parallel.pipeline.tied import tied_ends
from .parallel.recompute import apply_recompute
from .parallel.step import StepPlan
from .parallel.tensor import apply_tensor_parallel
from .parallel.zero import ZeroDataParallel
from .parallel.zero.flat import allocate
from .comm.compress import CompressSpec
from .layout import CP, DP, DP_CP, PP, TP


@dataclass(frozen=True)
class ParallelOptions:
    """What ``parallelize`` reads of a run (``Config.parallel_options()`` makes it): the
    layout and its strategies, the precision and recompute policies, and the shape of the
    activations a pipeline passes between stages."""

    parallel: object
    """The ``[parallel]`` section (``train.sections.ParallelConfig``)."""
    optim: object
    """The ``[optim]`` section (``train.sections.OptimConfig``): the engine owns the optimizer."""
    compress: CompressSpec
    """Data-parallel gradient compression, resolved (``Config.compress_spec``)."""
    precision: str = "fp32"
    """fp32; bf16 (autocast over fp32 weights; under ZeRO bf16 weights with fp32 masters);
    or bf16-params (bf16 weights with fp32 masters under every engine)."""
    recompute: str = "none"
    """Activation recomputation of the blocks."""
    seq_len: int = 128
    """Tokens per sequence (before context parallelism cuts it)."""
    micro_batch: int = 1
    """Sequences per microbatch."""
    d_model: int = 128
    """Width of the residual stream (the activation a pipeline stage sends)."""
    reshard_after_forward: bool = True
    """ZeRO-3: free gathered parameters after forward (True), or keep them to backward."""
    timeline: bool = False
    """Record a pipeline's schedule as it runs."""
    compile: bool = False
    """torch.compile each block and the loss after parallelizing (parallel/compile.py)."""


def parallelize(model: nn.Module, mesh: Mesh, opts: ParallelOptions) -> nn.Module:
    """Parallelize ``model`` (already on ``mesh.device``) for the layout in ``opts``; returns
    an engine (see parallel/engine.py) that owns the optimizer too. Under pipeline
    parallelism ``engine.module`` is the ``nn.ModuleList`` of this rank's chunks.

    Gradients are averaged over dp x cp: context-parallel ranks hold the same weights but
    see different tokens, exactly like data-parallel replicas.

    A model built on the meta device is cut as it is, and only this rank's share gets
    storage (zeros; ZeRO-3 units their shards): fill it with ``train.materialize.fill``.
    """
    p = opts.parallel
    desc = describe(model)
    # Experts first: tensor parallelism then counts this rank's share of them among the
    # parameters it replicates.
    ep = (apply_expert_parallel(model, desc, mesh.group(EP), mesh.group(EDP))
          if p.ep > 1 else None)
    tp = (apply_tensor_parallel(model, mesh.group(TP), sequence_parallel=p.sp, description=desc)
          if p.tp > 1 else None)
    if p.cp > 1:
        apply_context_parallel(model, mesh.group(CP), p.cp_method, description=desc)
    if desc.shape.n_experts and sequence_groups(mesh, p):  # routing counted per whole sequence
        split_sequences(model, desc, sequence_groups(mesh, p))
    pp_group, tied = None, None
    shared = model.get_submodule(desc.embedding).weight
    untied = model.get_submodule(desc.head).weight is not shared
    if p.pp > 1:
        model = nn.ModuleList(split_model(model, mesh.coord(PP), p.pp, p.virtual_stages,
                                          description=desc, placement=placement(p.schedule)))
        pp_group = mesh.group(PP)
        if not untied:  # the two ends of a tied embedding (parallel/pipeline/tied.py)
            tied = tied_ends(list(model), desc, mesh.groups.get(frozenset((EMBEDDING,))))
            if tied is not None and tied.is_copy and tp is not None:
                tp.adopt(shared, tied.param)  # the copy is split as the embedding is
    blocks = ([b for chunk in model for b in chunk.blocks()] if p.pp > 1
              else model.get_submodule(desc.blocks))
    apply_recompute(blocks, opts.recompute, core=desc.attention_core)
    if opts.compile:  # after every strategy changed the blocks; hooks stay outside
        # tp's vocabulary-parallel loss talks to its ranks: it stays eager.
        compile_regions(blocks, loss_modules(model, desc, p.pp) if p.tp == 1 else [],
                        eager=talking_operators(tp, blocks, desc.attention_core if p.cp > 1 else None))
    plan = step_plan(model, mesh, opts, moe=desc.shape.n_experts > 0)
    plan.tied_copy = ((f"{desc.head}.weight", f"{desc.embedding}.weight")
                      if p.pp > 1 and not untied else None)
    return _engine(model, mesh, opts, plan, ep, tp, pp_group, tied)


def _engine(model: nn.Module, mesh: Mesh, opts: ParallelOptions, plan, ep, tp, pp_group,
            tied) -> nn.Module:
    """The data-parallel engine over dp x cp that owns the optimizer: ZeRO's, or DDP's
    under a replicated (or, with --compress METHOD:update, a local-update) engine."""
    p, group = opts.parallel, mesh.group(DP_CP)
    compress = dataclasses.replace(opts.compress, place=place(mesh))
    if p.zero:  # lays out its flat units from meta parameters itself
        dtype = torch.bfloat16 if opts.precision in ("bf16", "bf16-params") else None
        plan.act_dtype = dtype or plan.act_dtype
        return ZeroDataParallel(model, group, p.zero, opts.optim, param_dtype=dtype,
                                offload=p.offload, tp=tp, pp_group=pp_group,
                                reshard_after_forward=opts.reshard_after_forward, compress=compress,
                                plan=plan, tied=tied, expert=ep,
                                **({"shard_group": mesh.group(SHARD), "replica_group": mesh.group(REPLICA)}
                                   if mesh.layout.hsdp else {}))
    allocate(model, mesh.device)
    if opts.precision == "bf16-params":  # before DDP makes its buckets: bf16 gradients
        cast_params(model, torch.bfloat16)
        plan.act_dtype = torch.bfloat16
    dp = DataParallel(model, group, bucket_mb=p.bucket_mb, compress=compress, defer=compress.update,
                      expert=ep, tied=tied)
    # --compress METHOD:update averages AdamW's updates, not gradients: an engine of its own.
    engine = LocalUpdateEngine if compress.update else ReplicatedEngine
    return engine(dp, opts.optim, tp, pp_group, plan=plan)


def loss_modules(model: nn.Module, desc, pp: int) -> list[nn.Module]:
    """The modules computing the loss on this rank: the model's, or under a pipeline the
    last stage's (none on other ranks)."""
    if pp == 1:
        return [model.get_submodule(desc.loss)]
    return [chunk.get_submodule(desc.loss) for chunk in model if chunk.is_last]


def talking_operators(tp, blocks, cp_core: str | None) -> list[tuple[object, str]]:
    """The operators inside the blocks that talk to other ranks, as (object, method):
    tensor parallelism's region entry and exit, and the attention core at path
    ``cp_core`` that context parallelism put in each block (parallel/compile.py)."""
    ops = [(tp.regions, "enter_overlapped"), (tp.regions, "exit")] if tp is not None else []
    return ops + ([(b.get_submodule(cp_core), "forward") for b in blocks] if cp_core else [])


def place(mesh: Mesh) -> str:
    """This rank's coordinate and size along each axis, e.g. 'dp1of2.tp0of2.pp0of1.cp0of1':
    what its gradient-compression state belongs to (``CompressSpec.place``). The same
    place holds the same parameter shard and data shard whatever the axes' order."""
    return ".".join(f"{axis}{mesh.coord(axis)}of{mesh.size(axis)}" for axis in (DP, TP, PP, CP))


def sequence_groups(mesh: Mesh, p) -> tuple:
    """The groups whose ranks hold different parts of the same sequences: cp, and tp under
    sequence parallelism (plain tp repeats every token on each of its ranks)."""
    return ((mesh.group(TP),) if p.sp and p.tp > 1 else ()) + ((mesh.group(CP),) if p.cp > 1 else ())


def step_plan(model: nn.Module, mesh: Mesh, opts: ParallelOptions, moe: bool = False) -> StepPlan:
    """What every step of the run shares (see parallel/step.py). Under pipeline parallelism
    ``model`` is the module list of this rank's chunks; ``moe``: the model has mixture-of-
    experts layers (on some stage: every stage then sums their figures with the others)."""
    p = opts.parallel
    local_seq = opts.seq_len // p.cp  # context parallelism: this rank's share
    stream_seq = local_seq // p.tp if p.sp else local_seq  # SP cuts the stream between stages
    device = mesh.device
    return StepPlan(
        chunks=list(model) if p.pp > 1 else [model], device=device,
        act_shape=(opts.micro_batch, stream_seq, opts.d_model),
        act_dtype=next(model.parameters()).dtype,
        schedule=p.schedule if p.pp > 1 else "1f1b",
        pp_group=mesh.group(PP) if p.pp > 1 else None,
        loss_groups=((mesh.group(PP),) if p.pp > 1 else ()) + (mesh.group(DP_CP),),
        cp_group=mesh.group(CP) if p.cp > 1 else None,
        positions=torch.arange(local_seq, device=device) if p.sp else None,
        average_over=mesh.size(DP_CP),
        # bf16 over fp32 weights needs autocast; ZeRO holds bf16 weights (fp32 masters),
        # and so does every engine under bf16-params.
        autocast_bf16=opts.precision == "bf16" and not p.zero,
        recorder=Recorder(rank=mesh.coord(PP)) if opts.timeline and p.pp > 1 else None,
        # MoE figures are summed over every rank that routed different tokens
        balance=Balance.find(list(model) if p.pp > 1 else [model],
                             (mesh.group(DP_CP),) + ((mesh.group(TP),) if p.sp and p.tp > 1 else ()),
                             mesh.group(PP) if p.pp > 1 else None) if moe else None)
