"""How a model's layers are cut into pipeline stages: one rule for ``train``, ``plan``
and the pipeline partition. Pure arithmetic, no torch.

Every virtual stage (pp x v of them) needs at least one block, with one exception: when
there are more virtual stages than blocks (at most two more), the first may hold only the
token embedding and the last only the final norm and output projection
(``check_pipeline_split``). That is how Llama 3 405B interleaves its 126 layers over 16
ranks x 8 chunks: 126 one-layer chunks, the embedding and the head as two of their own
(Llama 3 paper, §3.3.2). When the blocks divide evenly, each virtual stage gets the same
number (Megatron's split). When they do not (126 layers on 16 stages, BLOOM's 70 on 12),
the contiguous split that minimises the most expensive virtual stage is used, with the
token embedding counted on the first and the final norm and output projection on the
last, each as its parameters over one block's (``head_costs``): parameters are what a
stage must hold, and the head's matmul FLOPs per token (2·V·h) stand to a block's
(2·its parameters, plus attention) in about the same ratio. For Llama 3 405B on 16
stages this gives the split its authors describe: one layer fewer on the first and the
last stage.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence


class PipelineSplitError(ValueError):
    """A model that cannot be cut into the requested stages."""


def check_pipeline_split(n_layers: int, pp: int, virtual_stages: int = 1) -> None:
    """Raise ``PipelineSplitError`` unless the pp x v virtual stages can be cut: at least
    one block each, or, past one per block, the first and the last holding only the
    embedding and the head."""
    chunks = pp * virtual_stages
    if chunks > n_layers + 2:
        raise PipelineSplitError(
            f"{n_layers} layers cannot be split into pp={pp} x virtual_stages="
            f"{virtual_stages} = {chunks} chunks: each needs at least one layer, but for "
            f"the first and the last, which may hold only the embedding and the head; use "
            f"pp*virtual_stages <= {n_layers + 2}")


def empty_ends(n_layers: int, parts: int) -> bool:
    """Whether the first and last of ``parts`` runs may hold no block (more runs than
    blocks: they hold only the embedding and the head)."""
    return parts > n_layers


def head_costs(vocab_size: int, d_model: int, block_params: int,
               extra_embedding: int = 0) -> tuple[float, float]:
    """(embedding, head) cost in blocks: their parameters over one block's. The head is
    the final norm and an output projection of its own (pipelines untie it)."""
    embed = (vocab_size * d_model + extra_embedding) / block_params
    head = (vocab_size * d_model + d_model) / block_params
    return embed, head


def split_layers(n_layers: int, parts: int, layer_costs: Sequence[float] | None = None,
                 embed_cost: float = 0.0, head_cost: float = 0.0) -> list[range]:
    """Cut ``n_layers`` blocks into ``parts`` contiguous non-empty runs: evenly when they
    divide and no cost is given; otherwise the runs minimising the most expensive one,
    the embedding's cost counting toward the first and the head's toward the last (in
    units of one block when ``layer_costs`` is uniform)."""
    if not 1 <= parts <= n_layers + 2:
        raise PipelineSplitError(
            f"cannot split {n_layers} layers into {parts} pipeline chunks: every chunk "
            f"needs at least one layer, but for the first and the last; use "
            f"pp*virtual_stages <= {n_layers + 2}")
    if layer_costs is not None and len(layer_costs) != n_layers:
        raise ValueError(f"layer_costs has {len(layer_costs)} entries for {n_layers} layers")
    if layer_costs is None and not embed_cost and not head_cost and n_layers % parts == 0:
        size = n_layers // parts
        return [range(i * size, (i + 1) * size) for i in range(parts)]
    if layer_costs is None:
        return _split_uniform(n_layers, parts, embed_cost, head_cost)
    return _split_costed([float(c) for c in layer_costs], parts, embed_cost, head_cost)


def _front_loaded(n: int, parts: int, bound: float, embed: float, head: float,
                  ends: bool) -> list[int]:
    """Run sizes: each run as long as ``bound`` allows, leaving a layer for every run
    after it (none for the last when ``ends`` may be empty); the last run takes the rest."""
    sizes, left = [], n
    for k in range(parts - 1):
        room = int(bound - (embed if k == 0 else 0.0) + 1e-9)
        reserve = parts - k - 2 + (0 if ends else 1)
        take = max(0 if ends and k == 0 else 1, min(room, left - reserve))
        sizes.append(take)
        left -= take
    return sizes + [left]


def _split_uniform(n: int, parts: int, embed: float, head: float) -> list[range]:
    """Uniform blocks: the smallest bound whose front-loaded split fits, found by
    bisection over the values a run's cost can take (whole blocks plus the extras)."""
    ends = empty_ends(n, parts)
    extras = (0.0, embed, head, embed + head)
    bounds = sorted({k + e for k in range(0 if ends else 1, n + 1) for e in extras})

    def fits(bound: float) -> bool:
        sizes = _front_loaded(n, parts, bound, embed, head, ends)
        costs = [size + (embed if k == 0 else 0.0) + (head if k == parts - 1 else 0.0)
                 for k, size in enumerate(sizes)]
        return max(costs) <= bound + 1e-9

    lo, hi = 0, len(bounds) - 1  # the largest bound always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(bounds[mid]):
            hi = mid
        else:
            lo = mid + 1
    sizes = _front_loaded(n, parts, bounds[lo], embed, head, ends)
    starts = [sum(sizes[:k]) for k in range(parts)]
    return [range(a, a + size) for a, size in zip(starts, sizes)]


def _split_costed(costs: list[float], parts: int, embed: float, head: float) -> list[range]:
    """Per-layer costs: exact dynamic programme over the cut points (small models)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run_cost(a: int, b: int, k: int) -> float:  # layers a..b-1 as run k
        return (prefix[b] - prefix[a] + (embed if k == 0 else 0.0)
                + (head if k == parts - 1 else 0.0))

    # best[k][i]: smallest achievable maximum cost putting layers 0..i-1 into runs 0..k-1;
    # only the first and last run may be empty, and only with more runs than layers.
    ends = empty_ends(n, parts)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        may_be_empty = ends and k - 1 in (0, parts - 1)
        for i in range(n + 1):
            for j in range(i + 1 if may_be_empty else i):
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], run_cost(j, i, k - 1))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def pipeline_split(n_layers: int, pp: int, virtual_stages: int = 1, embed_cost: float = 0.0,
                   head_cost: float = 0.0) -> list[range]:
    """The layers of each of the pp x v virtual stages, as ``train`` and ``plan`` cut
    them: evenly when pp x v divides the layers (Megatron's split), else balanced with
    the embedding and head costs counted."""
    check_pipeline_split(n_layers, pp, virtual_stages)
    parts = pp * virtual_stages
    if n_layers % parts == 0:
        return split_layers(n_layers, parts)
    return split_layers(n_layers, parts, None, embed_cost, head_cost)


@lru_cache(maxsize=4096)
def stage_layer_counts(n_layers: int, pp: int, virtual_stages: int = 1,
                       embed_cost: float = 0.0, head_cost: float = 0.0) -> tuple[int, ...]:
    """Blocks each pipeline rank holds: rank r runs virtual stages r, r + pp, ..."""
    runs = pipeline_split(n_layers, pp, virtual_stages, embed_cost, head_cost)
    return tuple(sum(len(runs[c]) for c in range(r, pp * virtual_stages, pp))
                 for r in range(pp))
