"""Exposed data-parallel time of a step (gradient reduction, ZeRO's gathers, HSDP's
replica all-reduce) and the optimizer step: the terms of ``cost.step_time`` that depend on
the ZeRO stage (see ``plan.cost``'s module docstring for the overlap model)."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from .candidate import DEFAULT_RANK_ORDER, Candidate, Training
from .hardware import Cluster, Link, members_per_node
from . import moe
from .models import ModelSpec
from .overlap import exposed, link_collective_time, prefetched

if TYPE_CHECKING:
    from .cost import _Micro

ORDER = DEFAULT_RANK_ORDER  # paratrain's, fastest first; a runtime's is Training.rank_order
OPTIMIZER_BYTES = {"adam": 28, "sgd": 20}
"""Bytes the update reads and writes per parameter (gradient, master weight, states,
new weight): Adam 2 + 8 + 8 + 8 + 2, SGD with momentum 2 + 8 + 8 + 2 (same for fp32)."""


def max_stage_params(model: ModelSpec, cand: Candidate) -> int:
    """Parameters on the fullest pipeline rank: the first or last (embedding, head) or,
    with uneven stages, the second (the most blocks)."""
    return _max_stage_params(model, cand.tp, cand.pp, cand.virtual_stages)


@lru_cache(maxsize=1 << 12)
def _max_stage_params(model: ModelSpec, tp: int, pp: int, v: int) -> int:
    return max(model.stage_params(tp, pp, s, v) for s in {0, min(1, pp - 1), pp - 1})


def max_layers(model: ModelSpec, cand: Candidate) -> int:
    """Blocks on the fullest pipeline rank."""
    return max(model.stage_layer_counts(cand.pp, cand.virtual_stages))


def dp_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate,
             micro: _Micro) -> float:
    if cand.shard == 1:
        return 0.0
    link = cluster.link(cand.sizes(), training.rank_order, ("cp", "dp"))
    psi = max_stage_params(model, cand)
    experts = moe.stage_max_expert_params(model, cand)
    if not experts or cand.expert_shard == 1:  # every expert on its own rank: nothing to reduce
        return _reduce_time(model, training, cluster, cand, micro, psi, cand.shard, link)
    # A MoE model's expert gradients reduce over the ranks holding the same experts
    # (moe.expert_reduction): its own group and link, in the same backward window.
    edp = moe.expert_link(cluster, cand.layout, training.rank_order, data=True)
    if cand.zero == 0:  # one DDP reduction per group, hidden behind the same backward
        grad = 4 if cluster.kind == "local" else training.act_bytes
        comm = (link_collective_time(cluster, link, "all-reduce", psi * grad, cand.shard)
                + link_collective_time(cluster, edp, "all-reduce", experts * grad, cand.expert_shard))
        return exposed(comm, micro.bwd if training.dp_overlap else 0.0, cluster.gpu.overlap_cost)
    return (_reduce_time(model, training, cluster, cand, micro, psi, cand.shard, link)
            + _reduce_time(model, training, cluster, cand.but(zero=min(cand.zero, 2)), micro,
                           experts, cand.expert_shard, edp))


def _reduce_time(model: ModelSpec, training: Training, cluster: Cluster, cand: Candidate,
                 micro: _Micro, psi: float, n: int, link: Link) -> float:
    """Exposed seconds of reducing (and under ZeRO gathering) ``psi`` parameters' gradients
    over ``n`` ranks on ``link``."""
    weight = grad = training.act_bytes
    if cluster.kind == "local" and cand.zero == 0:
        grad = 4  # paratrain's bf16 data parallelism is autocast over fp32 weights and grads

    def coll(op: str, nbytes: float, window: float) -> float:
        return exposed(link_collective_time(cluster, link, op, nbytes, n), window,
                       cluster.gpu.overlap_cost)

    # Under a pipeline paratrain accumulates a stage's gradient through the step and
    # reduces it once (zero.md), whatever the microbatches.
    m = 1 if cand.pp > 1 else cand.microbatches
    window = micro.bwd if training.dp_overlap else 0.0
    if cand.zero == 0:
        return coll("all-reduce", psi * grad, window)
    # The optimizer step waits for the updated parameters' all-gather (zero/engine.py, as
    # DeepSpeed's does): nothing computes beside it.
    gather = coll("all-gather", psi * weight, 0.0)
    if cand.zero == 1:
        return coll(reduce_op(cluster), psi * grad, window) + gather
    if cand.zero == 2:
        return m * coll(reduce_op(cluster), psi * grad, window) + gather
    return _zero3_time(model, cluster, cand, micro, psi * weight, psi * grad, m,
                       training.rank_order)


def reduce_op(cluster: Cluster) -> str:
    """The collective ZeRO's gradient reduction runs as: a reduce-scatter, except on the
    local cluster's gloo, where paratrain all-reduces and keeps its slice because gloo's
    reduce-scatter is the slower of the two (``zero/engine.py``, ``paratrain bench comm``)."""
    return "all-reduce" if cluster.kind == "local" else "reduce-scatter"


def _zero3_time(model: ModelSpec, cluster: Cluster, cand: Candidate, micro: _Micro,
                weight_bytes: float, grad_bytes: float, m: int,
                order: tuple[str, ...] = ORDER) -> float:
    """ZeRO-3 / FSDP: per unit (one block) an all-gather of its parameters before forward,
    again before backward, and a reduce-scatter of its gradient after, every microbatch;
    kept through the step instead (``cand.reshards`` False, paratrain's default under a
    pipeline), one gather per unit and step. ``m`` reductions per step (1 under a
    pipeline, which accumulates the stage's gradient). With HSDP (``cand.shard_group``)
    over the shard group, then the replicas all-reduce their shard's gradient once per
    step."""
    n, g = cand.shard, cand.zero_shard
    link, replicas = zero3_links(cluster, cand, order)
    units = max_layers(model, cand)

    cost = cluster.gpu.overlap_cost
    gather = link_collective_time(cluster, link, "all-gather", weight_bytes / units, g)
    scatter = link_collective_time(cluster, link, reduce_op(cluster), grad_bytes / units, g)
    fwd = prefetched(gather, micro.fwd / units, units, cost)
    if not cand.reshards:
        total = fwd + m * prefetched(scatter, micro.bwd / units, units, cost)
    else:  # every microbatch gathers twice; the last (or each, without a pipeline) reduces
        gathers = cand.microbatches
        total = (gathers * fwd + (gathers - m) * prefetched(gather, micro.bwd / units, units, cost)
                 + m * prefetched(gather + scatter, micro.bwd / units, units, cost))
    if g < n:
        nbytes = grad_bytes / g
        total += exposed(link_collective_time(cluster, replicas, "all-reduce", nbytes, n // g),
                         micro.bwd, cost)
    return total


def zero3_links(cluster: Cluster, cand: Candidate,
                order: tuple[str, ...] = ORDER) -> tuple[Link, Link]:
    """(shard group's link, replica group's link) of ZeRO-3 / HSDP.

    Within a node the shard group uses NVLink. Across nodes each rank gets its own NIC,
    not the k NICs of its node's group members that a large all-reduce reaches: the
    published ZeRO-3 runs (Narayanan et al. 2021, Table 2: 66 s per step at both 768 and
    1536 GPUs while the compute per GPU halves) move their 3 x 2 bytes per parameter per
    step at about one HDR NIC's rate per GPU. HSDP's replicas, one per shard group and so
    at most ``k // g`` per node, all-reduce across nodes on that many NICs."""
    intra = cluster.intra_bw or cluster.gpu.nvlink_bw
    inter = cluster.inter_bw or cluster.gpu.network_bw
    n, g = cand.shard, cand.zero_shard
    sizes = cand.sizes()
    k = members_per_node(sizes, order, ("cp", "dp"), cluster.node_size)
    if g == n:
        shard = cluster.link(sizes, order, ("cp", "dp"), p2p=True)
    elif g <= k:
        shard = Link(intra, cluster.gpu.nvlink_alpha, "nvlink")
    else:
        shard = Link(min(intra, inter), cluster.gpu.network_alpha, "network")
    replicas = Link(min(intra, max(1, k // g) * inter), cluster.gpu.network_alpha, "network")
    return shard, replicas


def optimizer_time(model: ModelSpec, training: Training, cluster: Cluster,
                    cand: Candidate) -> float:
    psi = max_stage_params(model, cand)
    local = psi / (cand.zero_shard if cand.zero >= 1 else 1)  # HSDP: its group
    local += moe.stage_max_expert_params(model, cand) / (cand.expert_shard if cand.zero >= 1 else 1)
    return local * OPTIMIZER_BYTES[training.optimizer] / (cluster.gpu.optimizer_bw
                                                          or cluster.gpu.hbm_bw)
