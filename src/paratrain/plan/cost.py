"""Predicted time of one optimizer step: compute, pipeline bubble, exposed communication.

**Compute.** FLOPs are counted as Megatron-LM does (Narayanan et al. 2021): per block
and forward pass 2·T·(weights of its matmuls) plus 4·T·s·h for QK^T and softmax·V
(causal masking not discounted), the logits 2·T·h·V; backward costs twice the forward;
full recompute adds one forward of every block, selective recompute one forward of the
attention core. For the standard GPT block this is exactly Megatron's
96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with full recompute; without recompute it is the
72·… formula plus 1.5·B·s·h·V (that formula scales the logits term by 3/4 too, although
the logits are never recomputed). Each matmul runs at ``efficiency`` x peak unless it is
too small to be compute-bound: its time is max(FLOPs / achievable, bytes / HBM bandwidth).
CPU processes (the local cluster) also pay a measured fixed cost per block and
microbatch, ``GpuSpec.layer_overhead``: eager operator dispatch (0 on GPUs).

**Communication** uses the α-β ring costs of ``paratrain.comm.cost`` on the link the
axis's groups cross (``Cluster.link``, ranks ordered tp, cp, pp, dp from fastest), or
a collective's own measured α and β where the cluster has them (``GpuSpec.collectives``).
Per microbatch and stage: TP (with SP: all-gather + reduce-scatter, the same cost as
the all-reduce it replaces) 2 collectives forward and 2 backward per block, 2 more per
block when full recompute repeats the forward; CP ring attention passes K,V around the
ring (cp - 1 steps forward, K,V and their gradients backward), overlapped with the
attention core it feeds; PP sends one activation forward and one gradient backward per
model chunk. TP and PP time is exposed (on the critical path).

**Overlap of DP/ZeRO.** Gradient reduction starts while backward runs, bucket by bucket,
so it hides behind one microbatch's backward on the stage: DDP's all-reduce and ZeRO-1's
reduce-scatter once per step (gradients accumulate locally), ZeRO-2's reduce-scatter
after every microbatch (gradients are sharded, so they cannot accumulate), ZeRO-3's
parameter all-gather behind each microbatch's forward and backward. The updated
parameters' all-gather of ZeRO-1/2 hides behind the next step's first forward.
The part longer than the compute it overlaps is exposed, and the hidden part is not
free either: communication kernels take SMs and memory bandwidth from the compute they
run beside, charged as ``GpuSpec.overlap_cost`` of the hidden time (0.1 on GPUs, an
assumption, not a fit; 1 for CPU processes that fill every core, where gloo's threads
take their time from the compute). CP's exchange is charged the same way.

**Bubble.** With per-microbatch stage time t, a pipeline of p stages, m microbatches and
v chunks per rank idles (p - 1)/v · t per step: a bubble fraction (p - 1)/(v·m + p - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..comm import cost as alpha_beta
from .candidate import Candidate, Training
from .hardware import Cluster, Link
from .models import ModelSpec

ORDER = ("tp", "cp", "pp", "dp")  # Layout's default order, fastest first
OPTIMIZER_BYTES = {"adam": 28, "sgd": 20}
"""Bytes the update reads and writes per parameter (gradient, master weight, states,
new weight): Adam 2 + 8 + 8 + 8 + 2, SGD with momentum 2 + 8 + 8 + 2 (same for fp32)."""


# The search asks the same questions many times: remember the answers.
collective_time = lru_cache(maxsize=1 << 16)(alpha_beta.collective_time)
p2p_time = lru_cache(maxsize=1 << 12)(alpha_beta.p2p_time)


def link_collective_time(cluster: Cluster, link: Link, op: str, nbytes: float, p: int) -> float:
    """``op`` over ``link``, with the cluster's measured α and β for ``op`` if it has them."""
    alpha, beta = next(((a, b) for name, a, b in cluster.gpu.collectives if name == op),
                       (link.alpha, link.bw))
    return collective_time(op, nbytes, p, alpha, beta)


def exposed(comm: float, window: float, overlap_cost: float = 0.1) -> float:
    """Cost of ``comm`` seconds of communication overlapped with ``window`` of compute,
    of which ``overlap_cost`` of the hidden part still slows the step."""
    return max(0.0, comm - window) + overlap_cost * min(comm, window)


def megatron_flops(batch: int, s: int, layers: int, h: int, vocab: int,
                   full_recompute: bool) -> float:
    """Megatron-LM's FLOPs per iteration: 72 (96 with full recompute) · B·s·l·h² ·
    (1 + s/(6h) + V/(16·l·h))."""
    return (96 if full_recompute else 72) * batch * s * layers * h * h * (
        1 + s / (6 * h) + vocab / (16 * layers * h))


def layer_matmuls(model: ModelSpec, tokens: int, tp: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of one block's forward matmuls on one TP rank."""
    h, f = model.d_model, model.ffn_hidden
    kv = model.kv_heads_per_rank(tp) * model.head_dim
    mlp_in = 2 if model.gated_mlp else 1
    return [(tokens, h, h // tp + 2 * kv), (tokens, h // tp, h),
            (tokens, h, mlp_in * f // tp), (tokens, f // tp, h)]


def attention_core_flops(model: ModelSpec, b: int, s_q: int, s_kv: int, tp: int) -> float:
    """QK^T and softmax·V of one block's forward on one TP rank."""
    return 4 * b * s_q * s_kv * model.d_model / tp


def step_flops(model: ModelSpec, training: Training, recompute: str = "none") -> float:
    """FLOPs of one step over all ranks (``none``: the model FLOPs MFU is quoted in)."""
    tokens, s = training.tokens, training.seq_len
    matmul = sum(2 * m * k * n for m, k, n in layer_matmuls(model, tokens, 1))
    core = attention_core_flops(model, training.global_batch, s, s, 1)
    extra = {"none": 0.0, "selective": core, "full": matmul + core}[recompute]
    logits = 2 * tokens * model.d_model * model.vocab_size
    return model.n_layers * (3 * (matmul + core) + extra) + 3 * logits


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

    @property
    def step(self) -> float:
        return self.compute + self.bubble + self.tp + self.cp + self.pp + self.dp + self.optimizer


def max_stage_params(model: ModelSpec, cand: Candidate) -> int:
    """Parameters on the fullest pipeline rank: the first or last (embedding, head) or,
    with uneven stages, the second (the most blocks)."""
    return max(model.stage_params(cand.tp, cand.pp, s, cand.virtual_stages)
               for s in {0, min(1, cand.pp - 1), cand.pp - 1})


def max_layers(model: ModelSpec, cand: Candidate) -> int:
    """Blocks on the fullest pipeline rank."""
    return max(model.stage_layer_counts(cand.pp, cand.virtual_stages))


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1)/(v·m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def _matmul_time(m: int, k: int, n: int, flops: float, hbm: float, elem: int) -> float:
    return max(2 * m * k * n / flops, elem * (m * k + k * n + m * n) / hbm)


@dataclass(frozen=True)
class _Micro:
    """Per-microbatch times of the slowest (last) stage."""

    fwd: float
    """Forward of the stage's blocks and the logits."""
    bwd: float
    """Backward, plus whatever recompute repeats."""
    attention: float
    """Forward attention-core time of one block (what CP's exchange overlaps)."""


@lru_cache(maxsize=1 << 14)
def _micro_compute(model: ModelSpec, training: Training, cluster: Cluster, tp: int, cp: int,
                   pp: int, b: int, recompute: str, v: int = 1) -> _Micro:
    gpu, elem = cluster.gpu, training.act_bytes
    if training.precision == "bf16":
        flops = gpu.peak_flops * gpu.efficiency
    else:
        flops = gpu.peak_flops_fp32 * (gpu.efficiency_fp32 or gpu.efficiency)
    s_q = training.seq_len // cp
    tokens = b * s_q
    matmuls = sum(_matmul_time(m, k, n, flops, gpu.hbm_bw, elem)
                  for m, k, n in layer_matmuls(model, tokens, tp))
    attention = attention_core_flops(model, b, s_q, training.seq_len, tp) / flops
    logits = _matmul_time(tokens, model.d_model, model.vocab_size // tp, flops,
                          gpu.hbm_bw, elem)
    rerun = {"none": 0.0, "selective": attention, "full": matmuls + attention}[recompute]
    fixed = gpu.layer_overhead / 3  # per block pass; backward has twice forward's operators

    def stage(layers: int, head: float) -> tuple[float, float]:
        fwd = layers * (matmuls + attention + fixed) + head
        return fwd, 2 * fwd + layers * (rerun + (fixed if recompute == "full" else 0.0))

    # The slowest stage sets the pace: the last (it runs the logits) or, with uneven
    # stages, one holding more blocks.
    counts = model.stage_layer_counts(pp, v)
    fwd, bwd = max((stage(n, logits if s == pp - 1 else 0.0) for s, n in enumerate(counts)),
                   key=sum)
    return _Micro(fwd, bwd, attention)


def step_time(model: ModelSpec, training: Training, cluster: Cluster,
              cand: Candidate) -> StepTime:
    """Predicted time of one optimizer step of ``cand`` (see the module docstring)."""
    micro = _micro_compute(model, training, cluster, cand.tp, cand.cp, cand.pp,
                           cand.micro_batch, cand.recompute, cand.virtual_stages)
    tp, cp, pp = _micro_comm(model, training, cluster, Candidate(
        cand.dp, cand.tp, cand.pp, cand.cp, 0, cand.micro_batch, 1, cand.schedule,
        cand.virtual_stages, cand.recompute, cand.sequence_parallel))
    m, p, v = cand.microbatches, cand.pp, cand.virtual_stages
    per_micro = micro.fwd + micro.bwd + tp + cp + pp
    bubble = (p - 1) / v * per_micro
    return StepTime(compute=m * (micro.fwd + micro.bwd), bubble=bubble, tp=m * tp, cp=m * cp,
                    pp=m * pp, dp=_dp_time(model, training, cluster, cand, micro),
                    optimizer=_optimizer_time(model, training, cluster, cand))


@lru_cache(maxsize=1 << 14)
def _micro_comm(model: ModelSpec, training: Training, cluster: Cluster,
                cand: Candidate) -> tuple[float, float, float]:
    """Exposed tp, cp and pp time per microbatch (independent of the ZeRO stage and the
    microbatch count, which ``cand`` carries as 0 and 1 so the search shares them)."""
    micro = _micro_compute(model, training, cluster, cand.tp, cand.cp, cand.pp,
                           cand.micro_batch, cand.recompute, cand.virtual_stages)
    return (_tp_time(model, training, cluster, cand),
            _cp_time(model, training, cluster, cand, micro),
            _pp_time(model, training, cluster, cand))


def _tp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate) -> float:
    if cand.tp == 1:
        return 0.0
    link = cluster.link(cand.sizes(), ORDER, ("tp",))
    nbytes = cand.micro_batch * training.seq_len // cand.cp * model.d_model * training.act_bytes
    per_layer = 4 + (2 if cand.recompute == "full" else 0)
    count = per_layer * max_layers(model, cand) + 1  # + the output layer's
    return count * link_collective_time(cluster, link, "all-reduce", nbytes, cand.tp)


def _cp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate,
             micro: _Micro) -> float:
    if cand.cp == 1:
        return 0.0
    link = cluster.link(cand.sizes(), ORDER, ("cp",), p2p=True)
    kv = 2 * cand.micro_batch * training.seq_len // cand.cp * training.act_bytes * (
        model.kv_heads_per_rank(cand.tp) * model.head_dim)
    step = p2p_time(kv, link.alpha, link.bw)
    overlap = cluster.gpu.overlap_cost
    fwd = exposed((cand.cp - 1) * step, micro.attention, overlap)
    bwd = exposed((cand.cp - 1) * 2 * step, 2 * micro.attention, overlap)
    passes = 2 if cand.recompute == "full" else 1
    return max_layers(model, cand) * (passes * fwd + bwd)


def _pp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate) -> float:
    if cand.pp == 1:
        return 0.0
    link = cluster.link(cand.sizes(), ORDER, ("pp",), p2p=True)
    nbytes = (cand.micro_batch * training.seq_len // cand.cp * model.d_model
              * training.act_bytes / (cand.tp if cand.sp else 1))
    return 2 * cand.virtual_stages * p2p_time(nbytes, link.alpha, link.bw)


def _dp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate,
             micro: _Micro) -> float:
    n = cand.shard
    if n == 1:
        return 0.0
    link = cluster.link(cand.sizes(), ORDER, ("cp", "dp"))
    psi = max_stage_params(model, cand)
    weight = grad = training.act_bytes
    if cluster.kind == "local" and cand.zero == 0:
        grad = 4  # paratrain's bf16 data parallelism is autocast over fp32 weights and grads
    overlap = cluster.gpu.overlap_cost

    def coll(op: str, nbytes: float, calls: int = 1) -> float:  # calls pay α each
        return calls * link_collective_time(cluster, link, op, nbytes / calls, n)

    # Under a pipeline paratrain accumulates a stage's gradient through the step and
    # reduces it once, and ZeRO-3 keeps a stage's gathered units through the step
    # (zero.md): once per step, whatever the microbatches.
    m = 1 if cand.pp > 1 else cand.microbatches
    if cand.zero == 0:
        return exposed(coll("all-reduce", psi * grad), micro.bwd, overlap)
    gather = exposed(coll("all-gather", psi * weight), micro.fwd, overlap)
    if cand.zero == 1:
        return exposed(coll("reduce-scatter", psi * grad), micro.bwd, overlap) + gather
    if cand.zero == 2:
        return m * exposed(coll("reduce-scatter", psi * grad), micro.bwd, overlap) + gather
    units = max_layers(model, cand)  # ZeRO-3 gathers and reduces one block at a time
    fwd = exposed(coll("all-gather", psi * weight, units), micro.fwd, overlap)
    regather = coll("all-gather", psi * weight, units) if cand.pp == 1 else 0.0
    bwd = exposed(regather + coll("reduce-scatter", psi * grad, units), micro.bwd, overlap)
    return m * (fwd + bwd)


def _optimizer_time(model: ModelSpec, training: Training, cluster: Cluster,
                    cand: Candidate) -> float:
    psi = max_stage_params(model, cand)
    local = psi / (cand.shard if cand.zero >= 1 else 1)
    return local * OPTIMIZER_BYTES[training.optimizer] / (cluster.gpu.optimizer_bw
                                                          or cluster.gpu.hbm_bw)
