"""Predicted time of one optimizer step: compute, pipeline bubble, exposed communication.

**Compute.** FLOPs are counted as Megatron-LM does (``plan/flops.py``); their *time*
comes from the per-rank shapes (``plan/compute.py``): each GEMM, forward and both
backward products, at the rate of its shape on the GPU's measured curve, or its bytes over HBM bandwidth; the attention core
at a FlashAttention rate (or unfused, scores through HBM); norms, adds and activations
as memory-bound passes. CPU processes (the local cluster) also pay a measured fixed cost
per block and microbatch, ``GpuSpec.layer_overhead``: eager operator dispatch (0 on GPUs).

**Communication** uses the α-β ring costs of ``paratrain.comm.cost`` on the link the
axis's groups cross (``Cluster.link``, ranks ordered tp, cp, pp, dp from fastest), or
a collective's own measured α and β where the cluster has them (``GpuSpec.collectives``).
Per microbatch and stage: TP (with SP: all-gather + reduce-scatter, the all-reduce's
cost where they share α and β) 2 collectives forward and 2 backward per block, 2 more per
block when full recompute repeats the forward; CP ring attention passes K,V around the
ring (cp - 1 steps forward; backward K,V again and their fp32 gradients cp steps, the
last one home after the attention), overlapped with the attention core it feeds, while
Ulysses runs 4 all-to-alls forward (q, k, v to head sharding, the output back) and 4
backward, on the critical path; either recompute policy repeats CP's forward exchange
(the recomputed core is the CP attention); PP sends one activation forward and one gradient backward per
model chunk. TP and PP time is exposed (on the critical path), except each TP region's
backward entry reduction, which hides behind its column-parallel layers' weight-gradient
GEMMs (``Training.tp_backward_overlap``: paratrain's ``EnterColumnParallel``).

**Overlap of DP/ZeRO.** Gradient reduction starts while backward runs, bucket by bucket,
so it hides behind one microbatch's backward on the stage: DDP's all-reduce and ZeRO-1's
reduce-scatter once per step (gradients accumulate locally), ZeRO-2's reduce-scatter
after every microbatch (gradients are sharded, so they cannot accumulate). ZeRO-3
gathers and reduces unit by unit with a prefetch of one unit (``dp_cost._zero3_time``: the first
gather is exposed, later ones where longer than their unit's compute; across nodes one
NIC per rank), and HSDP adds a once-per-step all-reduce across its replicas. The updated
parameters' all-gather of ZeRO-1/2 is exposed: paratrain's optimizer step waits for it
(as DeepSpeed's does).
The part longer than the compute it overlaps is exposed, and the hidden part is not
free either: communication kernels take SMs and memory bandwidth from the compute they
run beside, charged as ``GpuSpec.overlap_cost`` of the hidden time (0.1 on GPUs, an
assumption, not a fit; 1 for CPU processes that fill every core, where gloo's threads
take their time from the compute: measured, a collective in flight beside compute costs
the step about its whole time, docs/plan.md). CP's exchange is charged the same way.

**Bubble.** With per-microbatch stage time t, a pipeline of p stages, m microbatches and
v chunks per rank idles (p - 1)/v · t per step: a bubble fraction (p - 1)/(v·m + p - 1).
The zero-bubble schedules (zbh1, zbv, dualpipev) idle less, by their simulated tables
with W half the backward (``simulator.idle_microbatches``; ZB-H1: (p - 1)(F + B - W)).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..parallel.pipeline.simulator import idle_microbatches
from ..parallel.pipeline.zero_bubble import KINDS as ZERO_BUBBLE
from .candidate import DEFAULT_RANK_ORDER, Candidate, Training
from .compute import attention_time, elementwise_bytes, matmul_time, unfused_attention_time
from .flops import attention_core_flops, layer_matmuls
from .hardware import Cluster
from . import mla, moe
from .models import ModelSpec
from .overlap import exposed, link_collective_time, p2p_time
from .dp_cost import dp_time, max_layers, optimizer_time

ORDER = DEFAULT_RANK_ORDER  # paratrain's, fastest first; a runtime's is Training.rank_order


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest rank; the fields add up to ``step``."""

    compute: float
    """Forward, backward and recompute of every microbatch."""
    bubble: float
    """Pipeline fill and drain."""
    tp: float
    """Exposed tensor/sequence-parallel collectives."""
    cp: float
    """Exposed ring-attention K/V exchange."""
    pp: float
    """Pipeline sends of activations and gradients."""
    dp: float
    """Exposed gradient reduction and ZeRO gathers."""
    optimizer: float
    """Optimizer update (memory-bound)."""
    ep: float | None = None
    """Exposed expert-parallel all-to-alls (``plan/moe.py``); None for a dense model, which
    has no such column."""

    @property
    def step(self) -> float:
        return (self.compute + self.bubble + self.tp + self.cp + self.pp + self.dp
                + self.optimizer + (self.ep or 0.0))


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1)/(v·m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


@dataclass(frozen=True)
class _Micro:
    """Per-microbatch times of the slowest (last) stage."""

    fwd: float
    """Forward of the stage's blocks and the logits."""
    bwd: float
    """Backward, plus whatever recompute repeats."""
    attention: float
    """Forward attention-core time of one block (what CP's exchange overlaps)."""


def _rates(training: Training, cluster: Cluster) -> tuple[float, float, float]:
    """(large-GEMM FLOP/s, long-sequence attention FLOP/s, half_dim) of the precision."""
    gpu = cluster.gpu
    if training.precision == "bf16":
        peak, eff, half = gpu.peak_flops, gpu.efficiency, gpu.half_dim
    else:
        peak = gpu.peak_flops_fp32
        eff = gpu.efficiency_fp32 or gpu.efficiency
        half = gpu.half_dim_fp32 or gpu.half_dim
    return peak * eff, peak * (gpu.attention_efficiency or eff), half


def _gemm_times(shapes, rate: float, half: float, gpu, elem: int) -> tuple[float, float]:
    """(forward, backward) seconds of GEMMs (M, K, N): forward X·W, backward the input
    gradient (M, N, K) and the weight gradient (K, M, N), each at its own shape's rate."""
    fwd = bwd = 0.0
    for m, k, n in shapes:
        fwd += matmul_time(m, k, n, rate, half, gpu, elem)
        bwd += matmul_time(m, n, k, rate, half, gpu, elem) + matmul_time(k, m, n, rate, half,
                                                                          gpu, elem)
    return fwd, bwd


@dataclass(frozen=True)
class _Block:
    """Seconds of one block's parts per microbatch on one rank (no pipeline, no recompute)."""

    matmul_fwd: float
    matmul_bwd: float
    attention: float
    """Forward attention core."""
    memory_bound: float
    """Forward elementwise passes."""
    head_fwd: float
    head_bwd: float


@lru_cache(maxsize=1 << 12)
def _block(model: ModelSpec, training: Training, cluster: Cluster, tp: int, cp: int, b: int,
           sp: bool) -> _Block:
    gpu, elem = cluster.gpu, training.act_bytes
    rate, att_rate, half = _rates(training, cluster)
    s_q = training.seq_len // cp
    tokens = b * s_q
    mm_fwd, mm_bwd = _gemm_times(layer_matmuls(model, tokens, tp), rate, half, gpu, elem)
    if training.flash_attention:
        attention = attention_time(attention_core_flops(model, b, s_q, training.seq_len, tp),
                                   s_q, att_rate, half)
    else:
        attention = unfused_attention_time(model, b, s_q, training.seq_len, tp, rate, half,
                                           gpu, elem)
    memory_bound = (elementwise_bytes(model, tokens, tp, sp and tp > 1, elem)
                    * training.speed.elementwise / gpu.hbm_bw)
    head_fwd, head_bwd = _gemm_times(((tokens, model.d_model, model.vocab_size // tp),),
                                     rate, half, gpu, elem)
    return _Block(mm_fwd, mm_bwd, attention, memory_bound, head_fwd, head_bwd)


@lru_cache(maxsize=1 << 14)
def _micro_compute(model: ModelSpec, training: Training, cluster: Cluster, tp: int, cp: int,
                   pp: int, b: int, recompute: str, v: int = 1, sp: bool = True,
                   ep: int = 1) -> _Micro:
    blk = _block(model, training, cluster, tp, cp, b, sp)
    attention, memory_bound = blk.attention, blk.memory_bound
    rerun = {"none": 0.0, "selective": attention,
             "full": blk.matmul_fwd + attention + memory_bound}[recompute]
    fixed = cluster.gpu.layer_overhead / 3  # per block pass; backward has twice forward's
    block_fwd = blk.matmul_fwd + attention + memory_bound + fixed
    block_bwd = blk.matmul_bwd + 2 * (attention + memory_bound + fixed) + rerun + (
        fixed if recompute == "full" else 0.0)

    moe_fwd = moe_bwd = 0.0
    if model.n_experts:
        moe_fwd, moe_bwd = moe.block_time(model, training, cluster, tp, cp, b, sp, ep)
        moe_bwd += moe_fwd if recompute == "full" else 0.0

    # The GPU waits for the host when the host's launches take longer than the kernels
    # (plan/speed.py): a backward is two passes, and full recompute adds the forward's.
    host = training.speed.host_block
    host_passes = 2 + (recompute == "full")

    def stage(s: int, layers: int) -> tuple[float, float]:
        last, experts = s == pp - 1, model.stage_moe_layers(pp, s, v)
        fwd = layers * block_fwd + experts * moe_fwd + (blk.head_fwd if last else 0.0)
        bwd = layers * block_bwd + experts * moe_bwd + (blk.head_bwd if last else 0.0)
        return max(fwd, layers * host), max(bwd, layers * host * host_passes)

    # The slowest stage sets the pace: the last (it runs the logits) or, with uneven
    # stages, one holding more blocks.
    counts = model.stage_layer_counts(pp, v)
    fwd, bwd = max((stage(s, n) for s, n in enumerate(counts)), key=sum)
    return _Micro(fwd, bwd, attention)


def step_time(model: ModelSpec, training: Training, cluster: Cluster,
              cand: Candidate) -> StepTime:
    """Predicted time of one optimizer step of ``cand`` (see the module docstring)."""
    micro, tp, cp, pp, ep = _per_microbatch(model, training, cluster, cand)
    m, p, v = cand.microbatches, cand.pp, cand.virtual_stages
    per_micro = micro.fwd + micro.bwd + tp + cp + pp + (ep or 0.0)
    # The zero-bubble schedules' W's fill part of it: their tables, simulated.
    idle = (idle_microbatches(cand.schedule, p, m, v, micro.bwd / micro.fwd)
            if cand.schedule in ZERO_BUBBLE and p > 1 else (p - 1) / v)
    bubble = idle * per_micro
    return StepTime(compute=m * (micro.fwd + micro.bwd), bubble=bubble, tp=m * tp, cp=m * cp,
                    pp=m * pp, dp=dp_time(model, training, cluster, cand, micro),
                    optimizer=optimizer_time(model, training, cluster, cand),
                    ep=None if ep is None else m * ep)


def time_without_bubble(model: ModelSpec, training: Training, cluster: Cluster,
                        cand: Candidate, zero_terms: bool = True) -> float:
    """``step_time(...).step`` less its bubble, without simulating the schedule (the
    search's bound, ``plan.bound``); ``zero_terms`` False also leaves out the
    data-parallel and optimizer terms, which depend on the ZeRO stage."""
    micro, tp, cp, pp, ep = _per_microbatch(model, training, cluster, cand)
    m = cand.microbatches
    t = m * (micro.fwd + micro.bwd) + m * tp + m * cp + m * pp + m * (ep or 0.0)
    return t + (_zero_terms(model, training, cluster, cand, micro) if zero_terms else 0.0)


def zero_terms_time(model: ModelSpec, training: Training, cluster: Cluster,
                    cand: Candidate) -> float:
    """The data-parallel and optimizer terms of ``step_time`` (those that depend on the
    ZeRO stage)."""
    micro = _micro_compute(model, training, cluster, cand.tp, cand.cp, cand.pp,
                           cand.micro_batch, cand.recompute, cand.virtual_stages, cand.sp,
                           cand.ep)
    return _zero_terms(model, training, cluster, cand, micro)


def _zero_terms(model, training, cluster, cand, micro) -> float:
    return (dp_time(model, training, cluster, cand, micro)
            + optimizer_time(model, training, cluster, cand))


def _per_microbatch(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate):
    """(compute, exposed tp, cp, pp and ep seconds) of one microbatch on the slowest stage."""
    micro = _micro_compute(model, training, cluster, cand.tp, cand.cp, cand.pp,
                           cand.micro_batch, cand.recompute, cand.virtual_stages, cand.sp,
                           cand.ep)
    # keyed without the schedule, which they do not depend on: its chunks are what count
    tp, cp, pp = _micro_comm(model, training, cluster, Candidate(
        cand.layout, 0, cand.micro_batch, 1, "interleaved" if cand.virtual_stages > 1 else "1f1b",
        cand.virtual_stages, cand.recompute, cand.sequence_parallel, cp_method=cand.cp_method))
    p, v = cand.pp, cand.virtual_stages
    # the fullest stage's MoE blocks' all-to-alls, on the critical path like pp's sends
    ep = moe.all_to_all_time(model, training, cluster, cand, _max_moe_layers(model, p, v)) \
        if model.n_experts else None
    return micro, tp, cp, pp, ep


@lru_cache(maxsize=1 << 12)
def _max_moe_layers(model: ModelSpec, pp: int, v: int) -> int:
    return max(model.stage_moe_layers(pp, s, v) for s in range(pp))


@lru_cache(maxsize=1 << 14)
def _micro_comm(model: ModelSpec, training: Training, cluster: Cluster,
                cand: Candidate) -> tuple[float, float, float]:
    """Exposed tp, cp and pp time per microbatch (independent of the ZeRO stage and the
    microbatch count, which ``cand`` carries as 0 and 1 so the search shares them)."""
    micro = _micro_compute(model, training, cluster, cand.tp, cand.cp, cand.pp,
                           cand.micro_batch, cand.recompute, cand.virtual_stages, cand.sp,
                           cand.ep)
    return (_tp_time(model, training, cluster, cand),
            _cp_time(model, training, cluster, cand, micro),
            _pp_time(model, training, cluster, cand))


def _tp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate) -> float:
    if cand.tp == 1:
        return 0.0
    link = cluster.link(cand.sizes(), training.rank_order, ("tp",))
    nbytes = cand.micro_batch * training.seq_len // cand.cp * model.d_model * training.act_bytes
    per_layer = 4 + (2 if cand.recompute == "full" else 0)
    count = per_layer * max_layers(model, cand) + 1  # + the output layer's
    # Sequence parallelism turns each all-reduce into an all-gather and a reduce-scatter:
    # the same ring time where they share α and β, not where they are measured apart (gloo).
    ops = ("all-gather", "reduce-scatter") if cand.sp else ("all-reduce",)
    one = sum(link_collective_time(cluster, link, op, nbytes, cand.tp) for op in ops)
    if not training.tp_backward_overlap:
        return count * one
    # The backward's two input-gradient reductions per block (QKV's and the MLP input's)
    # hide behind the same layer's weight-gradient GEMM; under SP only the reduce-scatter
    # half of each pair does, the all-gather before the row-parallel layer still waits.
    hidden = link_collective_time(cluster, link, ops[-1], nbytes, cand.tp)
    cost = cluster.gpu.overlap_cost
    rate, _, half = _rates(training, cluster)
    tokens = cand.micro_batch * training.seq_len // cand.cp
    mm = layer_matmuls(model, tokens, cand.tp)
    qkv, mlp_in = mm[0], mm[-2]
    backward = sum(one - hidden + exposed(hidden, matmul_time(k, m, n, rate, half, cluster.gpu,
                                                              training.act_bytes), cost)
                   for m, k, n in (qkv, mlp_in))
    layers = max_layers(model, cand)
    return (count - 2 * layers) * one + layers * backward


def _cp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate,
             micro: _Micro) -> float:
    if cand.cp == 1:
        return 0.0
    # Both recompute policies run the attention core's forward again, and under CP the
    # core is the CP attention, exchange included (parallel/recompute.py).
    passes = 1 if cand.recompute == "none" else 2
    if cand.cp_method == "ulysses":
        return max_layers(model, cand) * (passes + 1) * _ulysses_time(model, training, cluster, cand)
    link = cluster.link(cand.sizes(), training.rank_order, ("cp",), p2p=True)
    _, k, v, _ = mla.widths(model, cand.tp)
    kv = cand.micro_batch * training.seq_len // cand.cp * (k + v)
    step = p2p_time(kv * training.act_bytes, link.alpha, link.bw)
    grad_step = p2p_time(kv * 4, link.alpha, link.bw)  # dK, dV travel in fp32 (ring.py)
    overlap = cluster.gpu.overlap_cost
    fwd = exposed((cand.cp - 1) * step, micro.attention, overlap)
    # Backward: K, V go round again (cp - 1 hops) and dK, dV follow their block one hop
    # further, home to its owner (cp hops), the last after the attention has finished.
    bwd = exposed((cand.cp - 1) * (step + grad_step), 2 * micro.attention, overlap) + grad_step
    return max_layers(model, cand) * (passes * fwd + bwd)


def _ulysses_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate) -> float:
    """One attention's all-to-alls in one direction: q, k, v from sequence to head
    sharding and the output back (the backward pass runs the same four on gradients).
    nccl-tests' all-to-all size is each rank's input: its s/cp tokens of those heads."""
    link = cluster.link(cand.sizes(), training.rank_order, ("cp",))
    tokens = cand.micro_batch * training.seq_len // cand.cp
    return sum(link_collective_time(cluster, link, "all-to-all", tokens * n * training.act_bytes,
                                    cand.cp) for n in mla.widths(model, cand.tp))


def _pp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate) -> float:
    if cand.pp == 1:
        return 0.0
    link = cluster.link(cand.sizes(), training.rank_order, ("pp",), p2p=True)
    nbytes = (cand.micro_batch * training.seq_len // cand.cp * model.d_model
              * training.act_bytes / (cand.tp if cand.sp else 1))
    return 2 * cand.virtual_stages * p2p_time(nbytes, link.alpha, link.bw)
