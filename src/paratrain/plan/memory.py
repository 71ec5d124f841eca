"""Bytes one rank holds at its peak, by component.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, Table 1): with mixed
precision and Adam every parameter costs 2 (bf16 weight) + 2 (bf16 gradient) + K = 12
(fp32 master weight, momentum, variance) bytes, and ZeRO stage 1/2/3 shards the last
term / the last two / all three over the N ranks that hold the same parameters
(dp x cp here, since context-parallel ranks hold the same weights):

    stage 0: 16Ψ    stage 1: 4Ψ + 12Ψ/N    stage 2: 2Ψ + 14Ψ/N    stage 3: 16Ψ/N

Ψ is the parameters *of this rank* after tensor- and pipeline-parallel sharding.

Activations per layer follow Korthikanti et al. 2022 (16-bit, standard GPT block):
s·b·h·(34 + 5as/h) without TP, s·b·h·(10 + 24/t + 5as/(ht)) with TP t, s·b·h·(34/t +
5as/(ht)) with TP + sequence parallelism; selective recompute drops the 5as/h term,
full recompute keeps only the layer input, 2·s·b·h. ``layer_activation_bytes``
generalises the same accounting to grouped KV heads, SwiGLU, no dropout and fp32, and
reduces to those formulas for the standard block. A pipeline stage holds as many
microbatches of activations as its schedule has in flight (``inflight_microbatches``).
Under a pipeline ZeRO-2/3 accumulate the stage's full gradient through the step, as
paratrain does (and FSDP under torchtitan's pipelines), and ZeRO-3 kept gathered holds the
stage's parameters from the first forward to the last backward: both are buffers. The
gradient of a chunk is allocated by its first backward, so under interleaving the peak is
the worst moment of the schedule, activations still held plus the chunks' gradients
allocated so far (``peak_moment``): with few microbatches every forward runs before the
first backward and most of the gradient appears only as activations drain.

paratrain's own runs (the local cluster) are counted exactly instead, by ``plan.runtime``
(``paratrain_state_bytes`` is re-exported here): its ZeRO pads every unit to a multiple
of the shard group, its bf16 data parallelism runs autocast over fp32 weights (4 + 4 + 8
bytes per parameter), and its eager Llama-style block saves a different set of tensors
than Megatron's fused GPT block (fp32 norm statistics, separate bf16 casts, flash
attention without the s² scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..parallel.pipeline.posting import receives_ahead
from ..parallel.pipeline.schedules import ScheduleError, peak_inflight
from ..parallel.pipeline.zero_bubble import KINDS as ZERO_BUBBLE
from ..parallel.pipeline.zero_bubble import V_SHAPED
from . import mla, moe, runtime
from .candidate import Candidate, Training
from .models import ModelSpec
from .runtime import paratrain_state_bytes  # noqa: F401 - part of this module's API

BUCKET_BYTES = 4 * 2**20
"""Gradient communication bucket; mirrors the default of ``parallel/data.py`` (not
imported: that module needs torch)."""


@dataclass(frozen=True)
class Memory:
    """Peak bytes on the worst rank, by component."""

    params: float
    """Parameters (compute dtype, sharded by ZeRO-3)."""
    grads: float
    """Gradients (sharded by ZeRO-2/3)."""
    optimizer: float
    """Optimizer states incl. fp32 master weights (sharded by ZeRO-1/2/3)."""
    activations: float
    """Stored activations of every microbatch in flight."""
    buffers: float
    """Temporaries: gathered ZeRO-3 units, communication buckets, logits, recompute."""
    stage: int = 0
    """Pipeline stage this peak belongs to."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter: the ZeRO paper's 2, 2, K."""
    if precision == "bf16":  # fp32 master copy (4) + one fp32 state per moment
        return 2, 2, 12 if optimizer == "adam" else 8
    return 4, 4, 8 if optimizer == "adam" else 4


def training_bytes_per_param(training: Training) -> tuple[int, int, int]:
    """``bytes_per_param`` with the framework's extra fp32 gradient copy, if it keeps one
    (``Training.fp32_grad_copy``), counted as optimizer state."""
    weight, grad, k = bytes_per_param(training.precision, training.optimizer)
    return weight, grad, k + (4 if training.fp32_grad_copy else 0)


def model_state_bytes(psi: float, n: int, zero: int, weight: int = 2, grad: int = 2,
                      k: int = 12) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for ``psi`` parameters, ZeRO ``zero``
    over ``n`` ranks; the defaults are mixed-precision Adam."""
    return (psi * weight / (n if zero >= 3 else 1),
            psi * grad / (n if zero >= 2 else 1),
            psi * k / (n if zero >= 1 else 1))


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """The published per-layer activation bytes (16-bit, standard GPT block)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + attention)
    return s * b * h * (10 + 24 / t + attention)


@lru_cache(maxsize=1 << 14)
def layer_activation_bytes(model: ModelSpec, s: int, b: int, t: int, sp: bool,
                           recompute: str, elem: int = 2, flash: bool = True) -> float:
    """Activation bytes one block stores per microbatch on one TP rank (``s`` is the
    sequence per rank, i.e. already divided by cp).

    Counted tensors (sbh = s·b·h elements of ``elem`` bytes; masks are 1 byte):
    outside the TP region, both norm inputs, the QKV and MLP inputs, the dropout masks;
    inside it Q, K, V (K and V shrink with grouped KV heads), the output-projection input
    and the MLP's intermediates (GELU: its input and output; SwiGLU as Megatron-core's
    fused ``SwiGLUFunction`` and paratrain's block keep it: gate and up, and their
    product, which the output projection saves; silu(gate) is recomputed in backward,
    where an unfused block would store it too); the attention scores
    (softmax output, plus dropout mask and output when training with dropout) unless
    ``flash``: FlashAttention / SDPA's fused kernels (what Megatron-core with Transformer
    Engine, torchtitan and DeepSpeed run today) never store them, only one fp32
    log-sum-exp per row and head, and regenerate dropout masks from the RNG state.
    ``flash=False`` is Korthikanti et al.'s count (their runs predate FlashAttention).
    """
    h, a = model.d_model, model.n_heads
    sbh = s * b * h
    if recompute == "full":  # only the layer input survives
        return elem * sbh / (t if sp else 1)
    masks = 2 if model.dropout else 0
    outside = (4 * elem + masks) * sbh
    # q and the output projection's input, k and v
    attention = (2 * model.q_dim + 2 * model.n_kv_heads * model.head_dim) / h
    if model.mla is not None:  # plan/mla.py: MLA's q, k, v, output; its latents outside tp
        inside_elems, latent = mla.stored(model)
        attention, outside = inside_elems / h, outside + elem * latent * s * b
    mlp = (3 if model.gated_mlp else 2) * model.ffn_hidden / h  # SwiGLU: gate, up, product
    inside = elem * (attention + mlp) * sbh
    scores = 0.0
    if recompute == "none" and flash:  # fp32 log-sum-exp per row and head; no s x s
        scores = 4 * a * s * b
    elif recompute == "none":  # softmax output, plus dropout mask and output
        scores = (elem + (1 + elem if model.dropout else 0)) * a * s * s * b
    return outside / (t if sp else 1) + (inside + scores) / t


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1, stage: int = 0) -> float:
    """Microbatches' worth of one stage's activations alive at its peak.

    GPipe runs every forward before any backward: m. 1F1B warms up with p - stage
    forwards, then alternates: min(p - stage, m). Interleaved 1F1B (Megatron) warms up
    with 2(p - stage - 1) + (v - 1)p + 1 chunk-forwards of 1/v of the stage each, which
    on stage 0 is Korthikanti's factor 1 + (p - 1)/(pv) on a full model's layers.
    Without a pipeline one microbatch is alive at a time. The schedule tables of
    ``parallel/pipeline`` can replace this closed form: it is the one place that asks.
    The zero-bubble schedules' peaks are their tables' (ZB-H1 and ZBV: p on every rank,
    1F1B's first stage's; DualPipeV: p + 1/2).
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    if schedule in ZERO_BUBBLE:  # from the tables: a split backward holds them to its W
        return _zero_bubble_peaks(schedule, p, m, v)[stage]
    units = min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m)
    return units / v


def rank_memory(model: ModelSpec, training: Training, cand: Candidate,
                paratrain: bool = False, backend: str = "gloo") -> Memory:
    """The peak of the fuller of the first and last pipeline stages. ``paratrain``: count
    paratrain's own runtime exactly (``plan.runtime``) instead of the published formulas,
    on ``backend`` (on gloo its pipelines post receives early, holding more buffers)."""
    # The first and last stages hold the embedding and the head; with uneven stages the
    # second holds the most blocks at nearly the first's in-flight count.
    counts = model.stage_layer_counts(cand.pp, cand.virtual_stages)
    stages = sorted({0, cand.pp - 1} | ({1} if cand.pp > 2 and counts[1] > counts[0] else set()))
    if paratrain:
        ahead = receives_ahead(backend)
        peaks = [_paratrain_stage_memory(model, training, cand, s, ahead) for s in stages]
    else:
        peaks = [stage_memory(model, training, cand, s) for s in stages]
    if cand.schedule in V_SHAPED and cand.pp > 1:  # the V holds the head on rank 0 too
        peaks.append(_v_first_rank(model, training, cand, peaks[0], peaks[-1]))
    return max(peaks, key=lambda m: m.total)


def _v_first_rank(model: ModelSpec, training: Training, cand: Candidate, first: Memory,
                  last: Memory) -> Memory:
    """Rank 0 under a V (zbv, dualpipev), which holds the first stage and the last: the
    loop's stage 0 with the head's states added, and the larger of the two ends'
    activations and buffers (the last's hold the logits). The loop's last stage, counted
    too, holds more than the V's last rank: an upper bound there."""
    weight, grad, k = training_bytes_per_param(training)
    zero = cand.zero if cand.shard > 1 else 0
    head = model_state_bytes(model.head_params(cand.tp), cand.zero_shard, zero, weight, grad, k)
    return Memory(first.params + head[0], first.grads + head[1], first.optimizer + head[2],
                  max(first.activations, last.activations), max(first.buffers, last.buffers), 0)


def rank_states(model: ModelSpec, training: Training, cand: Candidate,
                paratrain: bool = False) -> float:
    """Bytes of parameters, gradients and optimizer states on the fullest rank: the
    ``states`` of ``rank_memory`` without counting activations (the search's first test)."""
    if paratrain:
        return rank_memory(model, training, cand, paratrain).states
    return max(sum(_state_bytes(model, training, cand, s))
               for s in {0, min(1, cand.pp - 1), cand.pp - 1})


def _state_bytes(model: ModelSpec, training: Training, cand: Candidate,
                 stage: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one rank of ``stage``: the dense parameters
    sharded by ZeRO over dp x cp, a MoE model's routed experts (n_experts / ep of each
    MoE block) over the dp x cp / ep ranks that hold the same experts."""
    weight, grad, k = training_bytes_per_param(training)
    zero = cand.zero if cand.shard > 1 else 0
    psi = model.stage_params(cand.tp, cand.pp, stage, cand.virtual_stages)
    dense = model_state_bytes(psi, cand.zero_shard, zero, weight, grad, k)
    if not model.n_experts:
        return dense
    experts = model.stage_expert_params(cand.pp, stage, cand.virtual_stages, cand.ep)
    held = model_state_bytes(experts, cand.expert_shard, zero if cand.expert_shard > 1 else 0,
                             weight, grad, k)
    return tuple(a + b for a, b in zip(dense, held))


def stage_memory(model: ModelSpec, training: Training, cand: Candidate, stage: int) -> Memory:
    """Peak bytes of one rank of pipeline ``stage``."""
    psi = model.stage_params(cand.tp, cand.pp, stage, cand.virtual_stages)
    zero = cand.zero if cand.shard > 1 else 0
    params, grads, opt = _state_bytes(model, training, cand, stage)
    s, b, elem = training.seq_len // cand.cp, cand.micro_batch, training.act_bytes
    per_layer = layer_activation_bytes(model, s, b, cand.tp, cand.sp, cand.recompute, elem,
                                       training.flash_attention)
    per_micro = per_layer * model.stage_layers(cand.pp, stage, cand.virtual_stages)
    if model.n_experts and cand.recompute != "full":  # full recompute keeps the block input only
        tokens = s * b // (cand.tp if cand.sp else 1)  # each tp rank routes its own shard
        per_micro += model.stage_moe_layers(cand.pp, stage, cand.virtual_stages) * \
            moe.activation_delta(model, tokens, cand.tp, elem, moe.load_factor(training, cand.ep))
    psi += model.stage_expert_params(cand.pp, stage, cand.virtual_stages, cand.ep)
    held_grad = bytes_per_param(training.precision, training.optimizer)[1] * psi
    inflight, fraction = peak_moment(cand, stage, per_micro, held_grad)
    buffers = _buffers(model, training, cand, stage, zero, inflight, fraction)
    return Memory(params, grads, opt, per_micro * inflight, buffers, stage)


def _paratrain_stage_memory(model: ModelSpec, training: Training, cand: Candidate,
                            stage: int, receives_ahead: int) -> Memory:
    states = runtime.paratrain_state_bytes(model, cand, training.precision, training.optimizer,
                                           stage)
    mode = runtime.precision_mode(training.precision, cand.zero)
    s, b = training.seq_len // cand.cp, cand.micro_batch
    per_layer = runtime.paratrain_layer_activation_bytes(model, s, b, cand.tp, cand.sp,
                                                         cand.recompute, mode)
    per_micro = per_layer * model.stage_layers(cand.pp, stage, cand.virtual_stages)
    if model.n_experts and cand.recompute != "full":
        tokens = s * b // (cand.tp if cand.sp else 1)
        per_micro += model.stage_moe_layers(cand.pp, stage, cand.virtual_stages) * \
            moe.paratrain_activation_delta(model, tokens, b, mode, cand.ep,
                                           moe.load_factor(training, cand.ep), cand.tp, cand.sp)
    held_grad = runtime.held_grad_bytes(model, cand, stage, training.precision)
    inflight, fraction = peak_moment(cand, stage, per_micro, held_grad)
    buffers = runtime.paratrain_buffer_bytes(model, training, cand, stage, receives_ahead,
                                             fraction)
    return Memory(states["param_bytes"], states["grad_bytes"], states["optim_bytes"],
                  per_micro * inflight, buffers, stage)


def peak_moment(cand: Candidate, stage: int, per_micro: float,
                held_grad: float) -> tuple[float, float]:
    """(microbatches of activations in flight, fraction of the stage's accumulated
    gradient allocated) at the peak of ``stage``: ``per_micro`` bytes of activations per
    microbatch, ``held_grad`` bytes of gradient accumulated through the step (ZeRO-2/3
    under a pipeline), one chunk's share allocated by each chunk's first backward."""
    inflight = inflight_microbatches(cand.schedule, cand.pp, cand.microbatches,
                                     cand.virtual_stages, stage)
    if not (cand.zero >= 2 and cand.shard > 1 and cand.pp > 1 and cand.virtual_stages > 1
            and cand.schedule == "interleaved"):  # the V's: counted whole at the peak
        return inflight, 1.0  # one chunk: its first backward runs at the activation peak
    v = cand.virtual_stages
    moments = first_backward_inflight(cand.pp, cand.microbatches, v, stage)
    return max(((alive, (j + 1) / v) for j, alive in enumerate(moments)),
               key=lambda moment: moment[0] * per_micro + moment[1] * held_grad)


def first_backward_inflight(p: int, m: int, v: int, stage: int = 0) -> tuple[float, ...]:
    """In-flight microbatches at the first backward of each chunk of ``stage`` under
    interleaved 1F1B, in the order those backwards run: the closed form of
    ``schedules.inflight_at_first_backwards`` (which walks the tables; a test holds them
    equal). After W = min(2(p - stage - 1) + (v - 1)p, mv) warm-up forwards, backward k
    runs with W + 1 units alive while forwards remain (k < mv - W), else mv - k; chunks
    are first reached at backwards 0, p, 2p, ... (microbatches go p at a time per chunk).
    Microbatches not in groups of p have no table: every moment is the peak."""
    total = m * v
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    if m % p:
        return (min(warmup + 1, total) / v,) * v
    return tuple((warmup + 1 if j * p < total - warmup else total - j * p) / v
                 for j in range(v))


def zero_buffer_bytes(model: ModelSpec, training: Training, cand: Candidate, stage: int,
                      zero: int, grad_fraction: float = 1.0) -> float:
    """Bytes ``stage`` holds at ZeRO ``zero`` beyond its sharded states, whatever the
    microbatch: gathered units, staging buckets and, under a pipeline, the accumulated
    gradient (``grad_fraction`` of it allocated; ``peak_moment``). The search's memory
    floor (``plan.bound``) takes its least over ZeRO-3's reshard choices."""
    weight, grad, _ = bytes_per_param(training.precision, training.optimizer)
    total = 0.0
    v = cand.virtual_stages
    psi = model.stage_params(cand.tp, cand.pp, stage, v) + model.stage_expert_params(
        cand.pp, stage, v, cand.ep)
    if zero >= 2 and cand.pp > 1:  # the stage's full gradient, accumulated through the step
        total += grad_fraction * psi * grad
    if zero == 3 and not cand.reshards:  # every unit kept gathered through the step
        total += psi * weight
    if zero == 3:  # the unit in use, the prefetched one, and one unit's unsharded grads
        unit = model.layer_params(cand.tp)
        if model.stage_moe_layers(cand.pp, stage, v):  # a MoE block is the largest unit
            unit += moe.replicated_delta(model, cand.tp) + moe.expert_params(model) // cand.ep
        total += unit * ((2 * weight if cand.reshards else 0) + (grad if cand.pp == 1 else 0))
    elif zero in (1, 2):  # reduce-scatter staging; DDP's buckets are the gradients
        total += 2 * BUCKET_BYTES
    return total


def _buffers(model: ModelSpec, training: Training, cand: Candidate, stage: int, zero: int,
             inflight: float, grad_fraction: float = 1.0) -> float:
    s, b, elem = training.seq_len // cand.cp, cand.micro_batch, training.act_bytes
    v = cand.virtual_stages
    total = zero_buffer_bytes(model, training, cand, stage, zero, grad_fraction)
    if stage == cand.pp - 1:  # vocab-parallel logits and their fp32 softmax
        total += s * b * model.vocab_size / cand.tp * (elem + 4) * logits_inflight(cand)
    if cand.recompute != "none":  # the layer being recomputed, briefly in full
        flash = training.flash_attention
        full = layer_activation_bytes(model, s, b, cand.tp, cand.sp, "none", elem, flash)
        total += full - layer_activation_bytes(model, s, b, cand.tp, cand.sp,
                                               cand.recompute, elem, flash)
        if cand.recompute == "full" and model.stage_moe_layers(cand.pp, stage, v):
            tokens = s * b // (cand.tp if cand.sp else 1)
            total += moe.activation_delta(model, tokens, cand.tp, elem,
                                          moe.load_factor(training, cand.ep))
    return total


def logits_inflight(cand: Candidate) -> int:
    """Microbatches whose logits are alive at once on the last stage: one, because the
    last (virtual) stage runs each microbatch's backward right after its forward under
    1F1B and interleaving alike; GPipe runs every forward first, so all m."""
    return cand.microbatches if cand.schedule == "gpipe" and cand.pp > 1 else 1


@lru_cache(maxsize=1 << 10)
def _zero_bubble_peaks(schedule: str, p: int, m: int, v: int) -> tuple[float, ...]:
    """Each rank's peak in flight under a zero-bubble table: ZB-H1 min(m, p) on every
    rank; with m >= 2p, ZBV p and DualPipeV p + 1/2 (closed forms of
    ``schedules.peak_inflight``, which tests/test_pipeline_zero_bubble.py holds them to);
    otherwise the table's. Sizes it cannot run count p + 1 (the search refuses them)."""
    if schedule == "zbh1":
        return (float(min(m, p)),) * p
    if m >= 2 * p:
        return (p + 0.5 if schedule == "dualpipev" else float(p),) * p
    try:
        return tuple(peak_inflight(schedule, p, m, v))
    except ScheduleError:
        return (p + 1.0,) * p
