"""What paratrain's own runtime holds per rank, counted exactly (the local cluster's
memory model; the published formulas of ``memory`` describe Megatron-style runtimes).

**Model states.** ZeRO (``parallel/zero``) flattens each *unit* (the token embedding,
each transformer block, the final norm, the output projection: ``default_units``) into
one buffer padded to a multiple of the shard group N = dp x cp, so per rank with
P = Σ_units ceil(Ψ_unit / N)·N:

    ZeRO-1: w·P + g·P + k·P/N    ZeRO-2: w·P + g·P/N + k·P/N    ZeRO-3: (w + g + k)·P/N

with (w, g, k) = (4, 4, 8) in fp32 and (2, 2, 12) in bf16 (bf16 weights and gradients;
fp32 master, momentum, variance). Plain data parallelism does not pad, and its bf16 is
autocast over fp32 weights: 4 + 4 + 8 bytes per parameter in either precision.

**Activations.** paratrain's block is Llama-style and eager: RMSNorm computed in fp32,
RoPE, grouped KV heads repeated for ``scaled_dot_product_attention`` (on CPU its flash
kernel: it saves q, k, v, the output and one fp32 log-sum-exp per row, never the s x s
scores), an unfused SwiGLU, no dropout. ``paratrain_layer_activation_bytes`` lists the
tensors it saves for backward; the list matches what ``saved_tensors_hooks`` sees
(tests/test_plan_vs_runs.py). Three precision modes: ``fp32``; ``autocast`` (bf16 under
plain data parallelism: fp32 residual stream and norms, and every linear layer saves
its own bf16 copy of its input); ``bf16`` (bf16 weights under ZeRO: bf16 residual
stream, norms still computed in fp32).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..parallel.pipeline import posting, schedules
from . import moe
from .candidate import Candidate, Training
from .models import ModelSpec

MODES = ("fp32", "autocast", "bf16")


def precision_mode(precision: str, zero: int) -> str:
    """How paratrain runs ``precision``: bf16 is autocast under plain data parallelism
    and bf16 weights (with fp32 masters) under ZeRO."""
    if precision == "fp32":
        return "fp32"
    return "bf16" if zero else "autocast"


def state_bytes_per_param(precision: str, zero: int, optimizer: str = "adam"
                          ) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter as paratrain stores them."""
    states = 2 if optimizer == "adam" else 1  # AdamW's two moments; SGD's momentum
    if precision_mode(precision, zero) == "bf16":
        return 2, 2, 4 + 4 * states  # fp32 master copy + fp32 moments
    return 4, 4, 4 * states


def block_params(model: ModelSpec, tp: int = 1) -> int:
    """Parameters of one paratrain block on one TP rank: two RMSNorm weights, wq, wk, wv,
    wo and SwiGLU's w1, w3, w2 (whatever biases or norm ``model`` names: paratrain builds
    its Llama-style block for every shape)."""
    h, f = model.d_model, model.ffn_hidden
    kv = model.kv_heads_per_rank(tp) * model.head_dim
    return (2 * h + 2 * h * model.q_dim // tp + 2 * h * kv + 3 * h * f // tp
            + model.qkv_bias_params(tp))


def unit_params(model: ModelSpec, tp: int = 1, pp: int = 1, stage: int = 0,
                v: int = 1) -> list[int]:
    """Parameters of each ZeRO unit on one rank of pipeline ``stage``, in model order:
    token embedding (first stage), the stage's blocks, final norm and output projection
    (last stage; a tied projection is the embedding itself unless stages separate them)."""
    h, vocab = model.d_model, -(-model.vocab_size // tp)  # paratrain pads it to a multiple of tp
    units = []
    if stage == 0:
        units.append(vocab * h)
    if model.n_experts:  # a MoE block: router, shared expert, gate and selection bias
        delta = moe.replicated_delta(model, tp) + moe.expert_bias_params(model)
        units += [block_params(model, tp) + (delta if model.is_moe(i) else 0)
                  for i in model.stage_blocks(pp, stage, v)]
    else:
        units += [block_params(model, tp)] * model.stage_layers(pp, stage, v)
    if stage == pp - 1:
        units.append(h)
        if not model.tie_embeddings or pp > 1:
            units.append(vocab * h)
    return units


def paratrain_state_bytes(model: ModelSpec, layout, precision: str, optimizer: str = "adam",
                          stage: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank of pipeline ``stage``
    holds in a paratrain run: ``param_bytes``, ``grad_bytes``, ``optim_bytes`` as
    ``train.loop.train`` measures them. ``layout`` is a ``Layout`` or ``Candidate`` (its
    dp, tp, pp, cp and zero are read)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r}: paratrain trains in fp32 or bf16")
    zero, v = layout.zero, getattr(layout, "virtual_stages", 1)
    replicas = layout.dp * layout.cp
    n = layout.shard_group or replicas  # HSDP: the dense units' shard group
    units = unit_params(model, layout.tp, layout.pp, stage, v)
    w, g, k = state_bytes_per_param(precision, zero, optimizer)
    if not model.n_experts:
        return dict(zip(("param_bytes", "grad_bytes", "optim_bytes"), _sharded(units, n, zero, (w, g, k))))
    # Each MoE block's n_experts / ep experts are a unit of their own, sharded over the ranks
    # holding the same experts. The selection biases (in ``units``) have neither gradient
    # nor optimizer state; under ZeRO they stay whole, in no unit, outside the engine's
    # state (n_experts values per block, not counted, as train measures its states).
    blocks = model.stage_moe_layers(layout.pp, stage, v)
    biases = blocks * moe.expert_bias_params(model)
    if zero:
        first = 1 if stage == 0 else 0
        units = units[:first] + [u - (moe.expert_bias_params(model) if model.is_moe(i) else 0)
                                 for i, u in zip(model.stage_blocks(layout.pp, stage, v), units[first:])
                                 ] + units[first + model.stage_layers(layout.pp, stage, v):]
    experts = [moe.expert_params(model) // layout.ep] * blocks
    states = [a + b for a, b in zip(_sharded(units, n, zero, (w, g, k)),
                                    _sharded(experts, replicas // layout.ep, zero, (w, g, k)))]
    untrained = (0, g * biases, k * biases) if not zero else (0, 0, 0)
    return dict(zip(("param_bytes", "grad_bytes", "optim_bytes"),
                    (a - b for a, b in zip(states, untrained))))


def _sharded(units: list[int], n: int, zero: int, sizes: tuple[int, int, int]) -> tuple[int, ...]:
    """(param, grad, optimizer) bytes of ``units`` on one rank: ZeRO pads each unit to a
    multiple of the ``n`` ranks it shards over and shards (weights ≥ 3, gradients ≥ 2,
    optimizer ≥ 1); without ZeRO every rank holds all of them, unpadded."""
    padded = sum(-(-u // n) * n for u in units) if zero else sum(units)
    return tuple(b * padded // (n if zero >= stage else 1) for b, stage in zip(sizes, (3, 2, 1)))


def paratrain_layer_activation_bytes(model: ModelSpec, s: int, b: int, t: int = 1,
                                     sp: bool = False, recompute: str = "none",
                                     mode: str = "fp32") -> float:
    """Bytes one paratrain block saves for backward per microbatch (``s`` tokens per
    sequence on this rank, ``b`` sequences): exact against saved-tensor hooks at t = 1 and
    t = 2 with and without SP (tests/test_plan_vs_runs.py). Per token, with c the
    compute dtype's bytes and r the residual stream's (fp32 4, 4; autocast 2, 4; bf16 2, 2):

    * each RMSNorm: its input in fp32 (4h: the input itself, or its fp32 copy), the
      normalised x (r·h, saved by the weight multiply), one fp32 rsqrt, and the input of
      the linear layers it feeds (c·h, once per layer under autocast, which casts
      separately for wq, wk, wv and for w1, w3);
    * attention: q, k, v (KV heads repeated to all heads) and the output of the flash
      kernel (4·c·h), its log-sum-exp (4 bytes per head), wo's input (c·h); selective
      recompute keeps only the kernel's inputs q, k, v before the repeat (c·(h + 2kv));
    * SwiGLU: gate, up and their product (3·c·f; silu(gate) is recomputed in backward);
    * full recompute: only the block input (r·h).
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    h, f, a = model.d_model, model.ffn_hidden, model.n_heads
    kv = model.kv_heads_per_rank(t) * model.head_dim
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    tokens = s * b
    if recompute == "full":
        return r * h * tokens / (t if sp else 1)

    def norm(consumers: int) -> float:
        inputs = consumers if mode == "autocast" else 1
        return 4 * h + r * h + 4 + inputs * c * h

    # The norms run on this rank's sequence shard under SP, but the linear layers save
    # the all-gathered full-sequence input, so that term is not divided by t.
    inputs = (5 if mode == "autocast" else 2) * c * h
    outside = (norm(3) + norm(2) - (inputs if sp else 0)) / (t if sp else 1) + (inputs if sp else 0)
    if recompute == "selective":
        attention = c * (h // t + 2 * kv) + c * h // t
    else:
        attention = 5 * c * h // t + 4 * a // t
    # With tp > 1 the row-parallel outputs (wo, w2: full h, full sequence, partial sums)
    # stay alive until backward: measured, tests/test_plan_peaks.py.
    row_parallel = 2 * c * h if t > 1 else 0
    inside = attention + 3 * c * f // t + row_parallel
    return tokens * (outside + inside)


def paratrain_buffer_bytes(model: ModelSpec, training: Training, cand: Candidate, stage: int,
                           receives_ahead: int, grad_fraction: float = 1.0) -> float:
    """Bytes beyond the stored activations at a paratrain rank's peak (measured with live
    storages, tests/test_plan_peaks.py). Always: autocast's bf16 copies of the weights
    (the graph keeps them until backward reaches their layer), the batch's token ids and
    targets (int64), under a pipeline the activations and gradients received and not yet
    read and those sent and not yet waited for (``held_buffers``), and ZeRO's buffers
    that live through the step (``held_zero_bytes``; ``grad_fraction`` of the accumulated
    gradient, ``memory.peak_moment``). Then the larger of two moments:

    * the start of the loss's backward on the last stage (``paratrain_head_bytes``);
    * the backward of a block: ZeRO's gathered units and full unit gradients, the
      block's recomputed activations (all of them with full recompute; the attention
      core with selective), and the MLP's two gradient temporaries (gate and up).
    """
    mode = precision_mode(training.precision, cand.zero)
    units = unit_params(model, cand.tp, cand.pp, stage, cand.virtual_stages)
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    weight = c
    s, b = training.seq_len // cand.cp, cand.micro_batch
    tokens = s * b
    total = 16.0 * tokens  # input ids and targets
    if mode == "autocast":
        norms = model.d_model * (2 * model.stage_layers(cand.pp, stage, cand.virtual_stages)
                                 + (stage == cand.pp - 1))
        matrices = sum(units) - norms - (units[0] if stage == 0 else 0)  # no embedding cast
        if model.n_experts:  # each local expert cast too; the selection biases are not
            v = cand.virtual_stages
            matrices += model.stage_expert_params(cand.pp, stage, v, cand.ep) - \
                model.stage_moe_layers(cand.pp, stage, v) * moe.expert_bias_params(model)
        total += 2 * matrices
    shard = model.d_model * tokens / (cand.tp if cand.sp else 1)
    if cand.pp > 1:  # received and not yet read; sent and not yet waited for
        total += sum(held_buffers(cand.schedule, cand.pp, cand.microbatches,
                                  cand.virtual_stages, stage, receives_ahead)) * r * shard
    total += held_zero_bytes(units, cand, weight, grad_fraction)
    block = 2 * c * model.ffn_hidden / cand.tp * tokens
    experts = model.stage_moe_layers(cand.pp, stage, cand.virtual_stages)
    if experts:  # a MoE block's gate and up gradients, and its dispatched rows' in and out,
        # are its routed rows' (tokens · top_k)
        block = max(block, 2 * c * (model.expert_ffn + model.d_model) * model.top_k * tokens)
    if cand.zero == 3 and cand.reshards:  # the unit in use and the prefetched one
        block += 2 * max(units) * weight
    if cand.zero >= 2 and cand.pp == 1:  # the gradient being reduced and the one assembled
        block += 2 * max(units) * weight
    if cand.recompute != "none":
        full, kept = (paratrain_layer_activation_bytes(model, s, b, cand.tp, cand.sp, policy, mode)
                      for policy in ("none", cand.recompute))
        block += full - (kept if cand.recompute == "selective" else 0)
        if experts and cand.recompute == "full":  # a MoE block recomputed whole
            block += moe.paratrain_activation_delta(model, tokens, b, mode, cand.ep,
                                                    moe.load_factor(training, cand.ep))
    head = paratrain_head_bytes(model, s, b, cand, mode) if stage == cand.pp - 1 else 0.0
    return total + max(head, block)


def held_zero_bytes(units: list[int], cand: Candidate, weight: int,
                    grad_fraction: float = 1.0) -> float:
    """ZeRO-2/3 buffers that live through a step (``parallel/zero/engine.py``): under a
    pipeline every unit's full gradient, accumulated from its first backward to its last;
    with ZeRO-3 kept gathered (``cand.reshards`` False), every unit's parameters, from
    its first forward to its last backward. ``weight``: bytes per element of both;
    ``grad_fraction``: the part of the gradient allocated at the moment counted."""
    if cand.zero < 2:
        return 0.0
    n = cand.dp * cand.cp
    padded = sum(-(-u // n) * n for u in units)  # the flat buffers, padded to n
    grads = padded if cand.pp > 1 else 0
    params = padded if cand.zero == 3 and not cand.reshards else 0
    return float(weight * (grad_fraction * grads + params))


def held_grad_bytes(model: ModelSpec, cand: Candidate, stage: int, precision: str) -> float:
    """The gradient ZeRO-2/3 accumulate through the step under a pipeline, all chunks'."""
    if cand.zero < 2 or cand.pp == 1:
        return 0.0
    units = unit_params(model, cand.tp, cand.pp, stage, cand.virtual_stages)
    weight = 4 if precision_mode(precision, cand.zero) == "fp32" else 2
    return held_zero_bytes(units, replace(cand, zero=2), weight)  # zero=2: no kept params


def paratrain_head_bytes(model: ModelSpec, s: int, b: int, cand: Candidate, mode: str) -> float:
    """What the last stage's head holds at its peak, the start of the loss's backward:
    the final RMSNorm's saved tensors (as a block's norm, feeding one linear layer) and
    the logits' loss buffers. The loss runs in fp32 (``.float()`` of the logits). With
    tp = 1, ``F.cross_entropy`` saves the log-softmax (4 bytes per logit) and its backward
    holds the NLL gradient and the log-softmax gradient (4 + 4) at once; the vocab-parallel
    loss (tp > 1) saves the softmax (4) and turns it into the gradient in place, plus a
    copy in the compute dtype when that is bf16. Only one microbatch's loss is in
    backward at a time; GPipe runs every forward first, so each of its m microbatches
    keeps the saved part."""
    t = cand.tp
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    h, tokens = model.d_model, s * b
    vocab = -(-model.vocab_size // t)
    norm = (4 * h + r * h + 4) / (t if cand.sp else 1) + c * h
    saved = 4 * vocab
    transient = 8 * vocab if t == 1 else (2 * vocab if c == 2 else 0)
    kept = cand.microbatches if cand.schedule == "gpipe" and cand.pp > 1 else 1
    return tokens * ((norm + saved) * kept + transient)


def held_buffers(kind: str, pp: int, microbatches: int, chunks: int, stage: int,
                 ahead: int) -> tuple[int, int]:
    """(receive buffers, sent tensors) a pipeline rank holds at once, from its table
    (``posting.held_buffers``), receives posted ``ahead`` computations early
    (``GLOO_RECEIVES_AHEAD`` on gloo, 0 on NCCL). A shape with no table (the search's
    probes, layouts it rejects for that) counts one buffer per direction and per
    computation ahead, and every send of the step."""
    # Past the warm-up the tables repeat, so a count stays flat in the microbatches or grows
    # by the same step per group (GPipe's first and last stages hold every send until
    # their first wait): the tables of 3·pp microbatches and one group fewer give every
    # rank's counts (tests/test_plan_memory.py pins this), and the search's thousands of
    # shapes share a few tables.
    group = pp if kind == "interleaved" else 1
    if microbatches <= 3 * pp or microbatches % group:
        return _held_buffers(kind, pp, microbatches, chunks, ahead)[stage]
    base = _held_buffers(kind, pp, 3 * pp, chunks, ahead)[stage]
    fewer = _held_buffers(kind, pp, 3 * pp - group, chunks, ahead)[stage]
    more = (microbatches - 3 * pp) // group
    return base[0] + more * (base[0] - fewer[0]), base[1] + more * (base[1] - fewer[1])


@lru_cache(maxsize=1 << 10)
def _held_buffers(kind: str, pp: int, microbatches: int, chunks: int,
                  ahead: int) -> tuple[tuple[int, int], ...]:
    try:
        tables = schedules.schedule(kind, pp, microbatches, chunks)
    except schedules.ScheduleError:
        return ((2 * (1 + ahead), 2 * microbatches * chunks),) * pp
    return tuple(posting.held_buffers(table, ahead) for table in tables)
