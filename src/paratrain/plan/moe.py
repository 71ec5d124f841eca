"""What a mixture of experts adds to the planner's counts (docs/plan.md, "Mixtures of
experts"); every function is 0 or empty for a dense model, so a dense plan is unchanged.

A MoE block replaces the dense MLP with a router (d_model x n_experts), n_experts routed
SwiGLU experts of width ``expert_ffn``, an optional shared expert (a SwiGLU of width
``shared_ffn``) and its sigmoid gate. Per token:

* **parameters.** total = dense parts + every expert; active = dense parts + router +
  top_k experts + the shared expert (``ModelShape.active_params``: what one token passes
  through, and what its FLOPs are counted on).
* **memory.** Expert parallelism (``Layout.ep``, folded onto the dp x cp ranks) gives each
  rank n_experts / ep experts of every MoE block; their gradients are reduced, and ZeRO
  shards their states, over the expert-data-parallel group of dp x cp / ep ranks (the
  ranks holding the same experts). The router and shared expert are dense parameters.
* **traffic.** Each rank sends its tokens' top_k rows to the ranks holding their experts
  and gets the results back: tokens · top_k · d_model · bytes · (ep - 1)/ep per rank and
  all-to-all, twice forward (dispatch, combine) and twice backward.
* **imbalance.** With ep > 1 the busiest rank receives ``Training.moe_imbalance`` (F)
  times the mean rows: its experts' GEMMs, their elementwise passes, its routed activations
  and the all-to-all it receives are F times the balanced ones (``load_factor``; exact
  with one expert per rank, an upper bound with several, whose loads average out). With
  ep = 1 every rank runs all its own tokens' rows whatever the routing: no headroom.
* **grouped GEMM.** The E/ep local experts run as one grouped GEMM of E/ep problems of
  tokens · top_k · ep / E rows each (``matmuls``): their tiles share the GPU's waves, and
  each runs at the rate of its own shape (``compute.gemm_efficiency``), so few rows per
  expert (small ep, few tokens per rank) are slower per FLOP than one GEMM of every row.

Tensor parallelism splits no part of a MoE block but its attention (``models/description.py``):
the router, the routed experts and the shared expert are whole on every tp rank, which runs
them on its own sequence shard under SP (on every token without SP).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from ..models.shape import ModelShape
from .candidate import DEFAULT_RANK_ORDER

if TYPE_CHECKING:  # the planner's types; moe.py is imported by the modules defining them
    from .candidate import Training
    from .hardware import Cluster

IMBALANCE_HELP = ("mixtures of experts: the busiest expert-parallel rank's routed rows over the "
                  "mean, scaling its experts' GEMMs, routed activations and received all-to-all "
                  "bytes when ep > 1 (default 1.0: balanced routing; no published max/mean load "
                  "was found to set it from, docs/plan.md)")
"""``--moe-imbalance``'s help."""

SHAPE_FIELDS = ("n_experts", "top_k", "expert_ffn", "shared_ffn", "shared_gate", "moe_every",
                "moe_first_dense")
"""The ``ModelShape`` fields of a mixture of experts, written back to a train config."""


def gpt_fields(model: ModelShape) -> dict:
    """The ``GPTConfig`` fields that make ``model``'s experts (none for a dense model)."""
    return {k: getattr(model, k) for k in SHAPE_FIELDS} if model.n_experts else {}


def check_shape(path, values: dict) -> None:
    """A [model] table's experts are a shape ``train`` builds: ValueError naming the field."""
    n, k = values["n_experts"], values["top_k"]
    if not 1 <= k <= n:
        raise ValueError(f"{path}: top_k = {k} must be between 1 and n_experts = {n}")
    if values.get("moe_every", 1) < 1:
        raise ValueError(f"{path}: moe_every = {values['moe_every']} must be at least 1")


def describe(model: ModelShape) -> str:
    """The experts for the planner's model line ('' for a dense model)."""
    if not model.n_experts:
        return ""
    shared = f" + shared {model.shared_ffn}" if model.shared_ffn else ""
    layers = sum(map(model.is_moe, range(model.n_layers)))
    return (f", {model.n_experts} experts x {model.expert_ffn} top-{model.top_k}{shared} "
            f"in {layers} MoE blocks")


def expert_params(model: ModelShape) -> int:
    """Routed-expert parameters of one MoE block, all experts (gate, up, down of each)."""
    return model.n_experts * 3 * model.d_model * model.expert_ffn


def replicated_delta(model: ModelShape, tp: int) -> int:
    """Parameters a MoE block holds on one tp rank beyond a dense block's, its routed
    experts left out (``expert_params``): the router, the shared expert and its gate
    (whole on every tp rank), less the dense MLP it replaces (split by tp)."""
    h = model.d_model
    dense_mlp = (3 if model.gated_mlp else 2) * h * model.ffn_hidden // tp
    shared = 3 * h * model.shared_ffn + (h if model.shared_gate else 0)
    return h * model.n_experts + shared - dense_mlp


# ---- FLOPs and compute --------------------------------------------------------------------

def load_factor(training: Training, ep: int) -> float:
    """The busiest rank's routed rows over the mean: ``Training.moe_imbalance`` with
    expert parallelism, 1 without (a rank holding every expert runs all its own rows)."""
    return training.moe_imbalance if ep > 1 else 1.0


def routed_rows(model: ModelShape, tokens: int, factor: float = 1.0) -> int:
    """Rows the experts of one rank run for ``tokens`` routed tokens: a rank receives as
    many rows as it sends, tokens · top_k, balanced; ``factor`` times that on the busiest."""
    rows = tokens * model.top_k
    return rows if factor == 1.0 else math.ceil(rows * factor)


def matmuls(model: ModelShape, tokens: int, tp: int, ep: int,
            factor: float = 1.0) -> list[tuple[int, int, int, int]]:
    """(M, K, N, count) of one MoE block's forward matmuls on one rank beyond attention:
    the router, the local experts' gate+up and down as grouped GEMMs of ``count`` problems
    (n_experts / ep experts of tokens · top_k · ep / n_experts rows each, ``factor`` times
    that on the busiest rank), the shared expert's."""
    h, local = model.d_model, model.n_experts // ep
    rows = max(1, routed_rows(model, tokens, factor) * ep // model.n_experts)
    shapes = [(tokens, h, model.n_experts, 1), (rows, h, 2 * model.expert_ffn, local),
              (rows, model.expert_ffn, h, local)]
    if model.shared_ffn:
        shapes += [(tokens, h, 2 * model.shared_ffn, 1), (tokens, model.shared_ffn, h, 1)]
    if model.shared_gate:
        shapes.append((tokens, h, 1, 1))
    return shapes


def flops_delta(model: ModelShape, tokens: int) -> float:
    """Forward FLOPs of one MoE block over ``tokens`` beyond a dense block's: 2 · tokens ·
    the active MLP weights (router, top_k experts, shared expert and gate) less the dense
    MLP's."""
    h = model.d_model
    active = (h * model.n_experts + model.top_k * 3 * h * model.expert_ffn
              + 3 * h * model.shared_ffn + (h if model.shared_gate else 0))
    return 2.0 * tokens * (active - (3 if model.gated_mlp else 2) * h * model.ffn_hidden)


def elementwise_delta(model: ModelShape, tokens: int, tp: int, elem: int,
                      factor: float = 1.0) -> float:
    """Bytes a MoE block's forward moves outside its matmuls beyond a dense block's: the
    experts' SwiGLU (read 2, write 1 per hidden unit) on the routed rows and the shared
    expert, the rows gathered for dispatch and scattered back (read and write d_model
    each), less the dense MLP's activation; ``factor``: the busiest rank's rows over the mean."""
    rows = routed_rows(model, tokens, factor)
    act = 3 * (rows * model.expert_ffn + tokens * model.shared_ffn)
    return elem * (act + 4 * rows * model.d_model - 3 * tokens * model.ffn_hidden // tp)


@lru_cache(maxsize=1 << 12)
def block_time(model: ModelShape, training: Training, cluster: Cluster, tp: int, cp: int,
               b: int, sp: bool, ep: int) -> tuple[float, float]:
    """(forward, backward) seconds a MoE block takes beyond a dense block per microbatch:
    its router, local experts and shared expert for the dense MLP (``moe.matmuls``; each
    tp rank routes its own sequence shard under SP), and their elementwise passes, on the
    busiest rank (``load_factor``); on an eager CPU, each local expert's operators and the
    routing's per-row kernels (``GpuSpec.moe_expert_overhead``, ``moe_row_cost``), split
    as ``layer_overhead`` is, a third forward."""
    from .cost import _gemm_times, _rates  # cost.py times the dense blocks and calls this
    from .flops import layer_matmuls

    gpu, elem = cluster.gpu, training.act_bytes
    rate, _, half = _rates(training, cluster)
    tokens = b * training.seq_len // cp
    routed = tokens // tp if sp and tp > 1 else tokens
    factor = load_factor(training, ep)
    fwd = bwd = 0.0
    for m, k, n, count in matmuls(model, routed, tp, ep, factor):
        f, g = grouped_gemm_times(m, k, n, count, rate, half, gpu, elem)
        fwd, bwd = fwd + f, bwd + g
    dense_f, dense_b = _gemm_times(layer_matmuls(model, tokens, tp)[-2:], rate, half, gpu, elem)
    memory = elementwise_delta(model, routed, tp, elem, factor) / gpu.hbm_bw
    eager = (gpu.moe_expert_overhead * (model.n_experts // ep)
             + gpu.moe_row_cost * routed_rows(model, routed, factor)) / 3
    return fwd - dense_f + memory + eager, bwd - dense_b + 2 * (memory + eager)


def grouped_gemm_times(m: int, k: int, n: int, count: int, rate: float, half: float, gpu,
                       elem: int) -> tuple[float, float]:
    """(forward, backward) seconds of a grouped GEMM of ``count`` (M, K, N) problems (the
    local experts' in one launch, as Megatron's and torchtitan's grouped GEMMs run them):
    each at its own shape's rate (``cost._gemm_times``' half-efficiency dimension), their
    tiles sharing the waves; backward the input and the weight gradients' groups."""
    from .compute import matmul_time

    def t(a: int, b: int, c: int) -> float:
        return matmul_time(a, b, c, rate, half, gpu, elem, count)

    return t(m, k, n), t(m, n, k) + t(k, m, n)


# ---- memory -------------------------------------------------------------------------------

def activation_delta(model: ModelShape, tokens: int, tp: int, elem: int,
                     factor: float = 1.0) -> float:
    """Activation bytes one MoE block stores per microbatch beyond a dense block's
    (``memory.layer_activation_bytes``), ``tokens`` routed on this rank: per routed row the
    dispatched input and the combined output (2 · d_model) and the expert's gate, up and
    product (3 · expert_ffn); per token the fp32 router scores (4 · n_experts) and the
    int64 expert indices (8 · top_k); the shared expert's gate, up and product; less the
    dense MLP's gate, up and product. ``factor``: the busiest rank's routed rows over the mean."""
    rows = routed_rows(model, tokens, factor)
    routed = elem * rows * (2 * model.d_model + 3 * model.expert_ffn)
    router = tokens * (4 * model.n_experts + 8 * model.top_k)
    mlp = 3 if model.gated_mlp else 2
    return routed + router + elem * tokens * (3 * model.shared_ffn - mlp * model.ffn_hidden / tp)


def paratrain_activation_delta(model: ModelShape, tokens: int, b: int, mode: str,
                               ep: int = 1, factor: float = 1.0, tp: int = 1,
                               sp: bool = False) -> float:
    """Bytes one paratrain MoE block (``models/moe.py``) saves for backward beyond its
    dense block (``runtime.paratrain_layer_activation_bytes``), ``tokens`` on this rank in
    ``b`` sequences; exact against saved-tensor hooks (tests/test_plan_moe.py). With c the
    compute dtype's bytes and r the residual stream's, per routed row (tokens · top_k):
    the experts' gate, silu(gate), up and product (4c · expert_ffn; the experts' SwiGLU is
    unfused), the gathered input (c · d_model, twice under autocast: w1 and w3 cast it
    apart), the experts' output and the combined rows (2c · d_model), the expert index and
    the row index (int64, 16) and the combine weight (r). Per token: the fp32 router
    scores (4 · n_experts), the chosen experts (int64, 8 · top_k), with renormalised
    weights their fp32 values and sum (4 · top_k + 4); under autocast the router's own
    cast of the norm output (c · d_model) in place of w1's and w3's; the shared expert
    (3c · shared_ffn, its two input casts under autocast) and its gate (its output c ·
    d_model, the sigmoid c, its input cast). Per sequence: the auxiliary loss's counts
    (4 · n_experts). Less the dense MLP's gate, up and product (3c · ffn_hidden). With
    ep > 1 the all-to-alls keep one more copy of the routed rows (c · d_model per row,
    measured: tests/test_plan_peaks.py). ``factor`` scales the per-row terms: the busiest
    rank's routed rows over the mean. Under tensor parallelism a MoE block has no
    row-parallel MLP output held in partial sums (the dense block's, c · d_model per token
    of the whole sequence), and under SP it routes its own sequence shard, so the MLP's
    all-gathered input (c · d_model per token, one per input cast under autocast) is not
    kept either (measured: tests/test_plan_peaks.py)."""
    c = 4 if mode == "fp32" else 2
    r = 2 if mode == "bf16" else 4
    h, k, autocast = model.d_model, model.top_k, mode == "autocast"
    routed = k * (4 * c * model.expert_ffn + c * h * (2 if autocast else 1) + 2 * c * h + 16 + r
                  + (c * h if ep > 1 else 0))
    # renormalising is a routing value: GPTConfig's field, or carried by a ModelSpec
    norm = getattr(model, "norm_topk", dict(getattr(model, "carried", ())).get("norm_topk", True))
    router = 4 * model.n_experts + 8 * k + (4 * k + 4 if norm else 0)
    casts = (1 - 2) * c * h if autocast else 0  # the router's cast instead of w1's and w3's
    shared = 0
    if model.shared_ffn:
        shared = 3 * c * model.shared_ffn + (2 * c * h if autocast else 0)
    if model.shared_gate:
        shared += c * h + c + (c * h if autocast else 0)
    per_token = routed + router + casts + shared - 3 * c * model.ffn_hidden
    whole = tokens * (tp if sp else 1)  # the sequence's tokens, which the dense block holds
    not_dense = whole * c * h * ((1 if tp > 1 else 0) + ((2 if autocast else 1) if sp else 0))
    return tokens * (per_token + (factor - 1) * routed) + 4 * model.n_experts * b - not_dense


def expert_bias_params(model: ModelShape) -> int:
    """The selection bias of one MoE block (n_experts values): a parameter paratrain saves
    like a weight, without gradient or optimizer state."""
    return model.n_experts


# ---- the expert-parallel group ------------------------------------------------------------

def expert_link(cluster, layout, order: tuple[str, ...], data: bool = False):
    """The link of rank 0's expert-parallel group (``data``: its expert-data-parallel
    group) under the runtime's rank ``order``: ``group_link`` of ``expert_group`` or
    ``expert_data_group``."""
    return _expert_link(cluster, layout, order, data)


@lru_cache(maxsize=1 << 16)  # a 2,048-GPU search meets thousands of layouts
def _expert_link(cluster, layout, order: tuple[str, ...], data: bool):
    return group_link(cluster, (expert_data_group if data else expert_group)(layout, order))


def expert_group(layout, order: tuple[str, ...] = DEFAULT_RANK_ORDER) -> tuple[int, ...]:
    """Rank 0's expert-parallel group (``Layout.expert_ranks``: where ep is folded) with
    the runtime's rank ``order`` (fastest first), the ranks its all-to-alls span."""
    return tuple(_ordered(layout, order).expert_ranks(0))


def expert_data_group(layout, order: tuple[str, ...] = DEFAULT_RANK_ORDER) -> tuple[int, ...]:
    """Rank 0's expert-data-parallel group (``Layout.expert_data_ranks``), over which its
    expert gradients are reduced."""
    return tuple(_ordered(layout, order).expert_data_ranks(0))


def _ordered(layout, order: tuple[str, ...]):
    text = "-".join(order)
    return layout if layout.order == text else replace(layout, order=text)


def stage_max_expert_params(model, cand) -> int:
    """Routed-expert parameters on the fullest pipeline rank of ``cand`` (0: dense)."""
    return _stage_max_expert_params(model, cand.pp, cand.virtual_stages, cand.ep) \
        if model.n_experts else 0


@lru_cache(maxsize=1 << 12)
def _stage_max_expert_params(model, pp: int, v: int, ep: int) -> int:
    return max(model.stage_expert_params(pp, s, v, ep) for s in range(pp))


def group_link(cluster, ranks: tuple[int, ...]):
    """The link a collective over ``ranks`` uses: NVLink inside one node; across nodes
    the network on as many NICs as the group has members in a node (``Cluster.link``'s
    rule for an axis group, for a group that is not one axis)."""
    from .hardware import Link

    node = cluster.node_size
    intra = cluster.intra_bw or cluster.gpu.nvlink_bw
    if len({r // node for r in ranks}) == 1:
        return Link(intra, cluster.gpu.nvlink_alpha, "nvlink")
    k = sum(r // node == ranks[0] // node for r in ranks)
    inter = cluster.inter_bw or cluster.gpu.network_bw
    return Link(min(intra, k * inter), cluster.gpu.network_alpha, "network")


def all_to_all_bytes(model: ModelShape, tokens: int, elem: int, ep: int) -> float:
    """Bytes one rank sends (and receives) in one dispatch or combine all-to-all:
    tokens · top_k · d_model · elem · (ep - 1)/ep (a 1/ep share of its rows stays home)."""
    return tokens * model.top_k * model.d_model * elem * (ep - 1) / ep


def all_to_all_time(model, training, cluster, cand, layers: int) -> float:
    """Seconds per microbatch of the all-to-alls of ``layers`` MoE blocks: dispatch and
    combine forward, the same two on gradients backward, and again forward under full
    recompute; exposed (the experts wait for their rows). The collective's size is each
    rank's whole input, as nccl-tests' all-to-all counts it (``comm.cost``), on the busiest
    rank (``load_factor``)."""
    ep = cand.layout.ep
    if ep == 1 or not layers:
        return 0.0
    from .overlap import link_collective_time

    tokens = cand.micro_batch * training.seq_len // cand.cp // (cand.tp if cand.sp else 1)
    # the busiest rank receives (and sends back) load_factor times the mean rows
    full = tokens * model.top_k * model.d_model * training.act_bytes * load_factor(training, ep)
    link = expert_link(cluster, cand.layout, training.rank_order)
    one = link_collective_time(cluster, link, "all-to-all", full, ep)
    passes = 4 + (2 if cand.recompute == "full" else 0)
    return layers * passes * one
