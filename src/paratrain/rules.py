"""Which model shapes a layout can split, and which strategies combine: every rule once.

``train``'s config check, the planner's search and the strategies themselves call these
functions, so a rule is changed in one place and its wording is the same wherever it
fires. Each raises ``LayoutError`` naming the numbers and the fix.

``check_split`` applies every shape rule to a model and a layout; the strategies call
the one rule that concerns them, at the moment they would otherwise fail.
"""

from __future__ import annotations

from .layout import Layout, LayoutError
from .models.shape import ModelShape
from .stages import PipelineSplitError, check_pipeline_split


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Tensor parallelism gives each rank whole query heads, and whole KV heads (split
    when there are at least tp of them, one replicated head per rank otherwise)."""
    def valid() -> list[int]:  # only when refusing: the planner calls this per candidate
        return [t for t in divisors(n_heads) if n_kv_heads % t == 0 or t % n_kv_heads == 0]

    if n_heads % tp:
        raise LayoutError(f"tp={tp} must divide the {n_heads} attention heads; pick tp from {valid()}")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise LayoutError(f"tp={tp} and the {n_kv_heads} KV heads must divide one another "
                          f"(KV heads are split when kv_heads >= tp, replicated otherwise); "
                          f"pick tp from {valid()}")


def mlp_width(ffn: int, tp: int) -> None:
    """Tensor parallelism splits the MLP's hidden units evenly."""
    if ffn % tp:
        raise LayoutError(f"tp={tp} must divide the MLP width ffn_hidden={ffn}; "
                          f"pick tp from {[t for t in divisors(ffn) if t <= 64]}")


def pipeline_split(n_layers: int, pp: int, virtual_stages: int = 1) -> None:
    """Every virtual stage holds at least one block, but for ends that hold only the embedding
    or the head (uneven splits are balanced; ``paratrain.stages``)."""
    try:
        check_pipeline_split(n_layers, pp, virtual_stages)
    except PipelineSplitError as err:
        raise LayoutError(str(err)) from None


def batch(global_batch: int, dp: int, micro_batch: int = 1) -> None:
    """Each data-parallel replica takes an equal share of the global batch, in whole
    micro-batches (gradient accumulation runs share / micro_batch of them)."""
    if global_batch % dp:
        raise LayoutError(f"global_batch={global_batch} is not divisible by dp={dp}; "
                          f"use a multiple of {dp}")
    if (global_batch // dp) % micro_batch:
        raise LayoutError(f"each rank gets {global_batch // dp} sequences per step, not a "
                          f"multiple of micro_batch={micro_batch}")


def interleaved_microbatches(microbatches: int, pp: int) -> None:
    """The interleaved schedule runs microbatches in groups of pp (Megatron's rule)."""
    if pp > 1 and microbatches % pp:
        fix = max(pp, microbatches // pp * pp)
        raise LayoutError(f"interleaved 1F1B runs microbatches in groups of pp={pp}, but "
                          f"microbatches={microbatches} is not a multiple of {pp}; use "
                          f"--microbatches {fix} or {fix + pp}")


def virtual_stages(v: int, schedule: str) -> None:
    """Several chunks per pipeline rank only make sense for the interleaved schedule (and
    the V-shaped zbv and dualpipev, two chunks each)."""
    if v > 1 and schedule not in ("interleaved", "zbv", "dualpipev"):
        raise LayoutError(f"virtual_stages={v} needs --schedule interleaved, zbv or dualpipev "
                          f"(not {schedule})")


def tied_embeddings(tied: bool, pp: int, zero: int = 0, local_update: bool = False,
                    schedule: str = "") -> None:
    """A tied embedding is one tensor used at both ends of the model: ZeRO keeps it in one
    unit gathered at both ends; a pipeline keeps a copy on the last stage whose gradient is
    summed with the first stage's (parallel/pipeline/tied.py) before the data-parallel
    reduction, which ZeRO-2/3 start during backward."""
    if tied and pp > 1 and zero >= 2:
        raise LayoutError(f"tied embeddings under a pipeline with ZeRO-{zero} are not supported "
                          f"yet (the last stage's copy must add the first stage's gradient "
                          f"before ZeRO-{zero} shards it): use zero = 0 or 1, or set "
                          f"tie_embeddings = false")
    if tied and pp > 1 and local_update:
        raise LayoutError("tied embeddings under a pipeline with --compress METHOD:update are not "
                          "supported yet (the two ends' copies would be updated apart): drop "
                          ":update, or set tie_embeddings = false")
    if tied and pp > 1 and schedule in ("zbv", "dualpipev"):
        raise LayoutError(f"tied embeddings with --schedule {schedule} are not supported: its V "
                          f"places the embedding and the head both on pipeline rank 0, where "
                          f"the two-rank tied copy does not apply; use --schedule zbh1, or set "
                          f"tie_embeddings = false")


def context(cp: int, method: str, seq_len: int, local_heads: int, local_kv: int) -> None:
    """Ring attention cuts each sequence into 2 cp chunks (causal load balance); Ulysses
    also splits this rank's heads over cp."""
    if cp == 1:
        return
    if seq_len and seq_len % (2 * cp):
        raise LayoutError(f"context parallelism with cp={cp} cuts the sequence into 2*cp={2 * cp} "
                          f"chunks for causal load balance, but seq_len={seq_len} is not "
                          f"divisible by {2 * cp}; use a multiple of {2 * cp}")
    if method == "ulysses" and (local_heads % cp or local_kv % cp):
        raise LayoutError(f"Ulysses splits attention heads over cp={cp} ranks, but each rank "
                          f"holds {local_heads} query heads and {local_kv} KV heads, which cp "
                          f"does not both divide; use --cp-method ring, or a cp from "
                          f"{divisors(local_kv)}")


def sequence_parallel_splits(tp: int, cp: int, seq_len: int) -> bool:
    """Whether each context-parallel rank's tokens split evenly over the tp ranks."""
    return (seq_len // cp) % tp == 0


def sequence_parallel(sp: bool, tp: int, cp: int, seq_len: int) -> None:
    """Megatron-SP cuts each rank's tokens over the tensor-parallel group."""
    if sp and tp == 1:
        raise LayoutError("sequence parallelism shards the sequence over the tensor-parallel "
                          "group: it needs --tp > 1")
    if sp and not sequence_parallel_splits(tp, cp, seq_len):
        raise LayoutError(f"sequence parallelism splits each rank's {seq_len // cp} tokens over "
                          f"tp={tp}; use a seq_len divisible by {tp * cp}")


def experts(shape: ModelShape, layout: Layout) -> None:
    """Expert parallelism splits each MoE layer's experts over ep of the dp x cp ranks."""
    if layout.ep > 1 and not shape.n_experts:
        raise LayoutError(f"ep={layout.ep} splits experts over ranks, but the model has none: "
                          f"set n_experts (a mixture of experts) or drop --ep")
    if shape.n_experts % layout.ep:
        raise LayoutError(f"ep={layout.ep} must divide the {shape.n_experts} experts of each "
                          f"MoE layer; use ep in {divisors(shape.n_experts)} dividing dp x cp = "
                          f"{layout.dp * layout.cp}")


def expert_strategies(n_experts: int, ep: int, zero: int, compress: str, *,
                      capacity_factor: float = 0.0, splits_sequences: bool = False) -> None:
    """Expert parallelism's experts are averaged plainly over their own group; a capacity
    limit decides drops by a token's place in its whole sequence, which no rank knows
    where cp or sequence parallelism splits sequences."""
    if n_experts and capacity_factor and splits_sequences:
        raise LayoutError(f"capacity_factor={capacity_factor} drops tokens by their place in the "
                          f"whole sequence, which cp and sequence parallelism split over ranks: "
                          f"train dropless (capacity_factor 0) or with cp=1 and sp off")
    if ep > 1 and compress != "none":
        raise LayoutError(f"ep={ep} with --compress {compress} is not supported yet: use "
                          f"--compress none")


def compiled(compile: bool, n_experts: int, split_backward: str = "") -> None:
    """``--compile`` compiles whole transformer blocks. A mixture-of-experts block routes
    tokens with data-dependent shapes (bincount, ``.item()``), which split it into some
    twenty graphs recompiled as the routing changes (measured: 23 graph breaks and 97 s
    for 3 steps of a 2-layer model on CPU, against 7 s eager). ``split_backward``: the
    pipeline schedule, when it splits each backward into input and weight halves at
    autograd's nodes (zero-bubble schedules); a compiled block's backward is one node that
    computes both, and frees its saved buffers on the first pass."""
    if compile and n_experts:
        raise LayoutError(f"--compile with a mixture of experts (n_experts={n_experts}) is not "
                          f"supported: routing's data-dependent shapes break each block into "
                          f"many recompiled graphs; drop --compile")
    if compile and split_backward:
        raise LayoutError(f"--compile with --schedule {split_backward} is not supported: the "
                          f"schedule splits each block's backward into its input and weight "
                          f"halves, and a compiled block's backward is one piece; use --schedule "
                          f"1f1b or interleaved, or drop --compile")


def check_split(shape: ModelShape, layout: Layout, *, virtual_stages: int = 1, seq_len: int = 0,
                cp_method: str = "ring") -> None:
    """Every rule about cutting a model of ``shape`` over ``layout``, with ``virtual_stages``
    model chunks per pipeline rank and context parallelism by ``cp_method`` (``seq_len`` 0:
    not known yet, the sequence rules skipped)."""
    t = layout.tp
    heads(shape.n_heads, shape.n_kv_heads, t)
    mlp_width(shape.ffn_hidden, t)
    pipeline_split(shape.n_layers, layout.pp, virtual_stages)
    context(layout.cp, cp_method, seq_len, shape.n_heads // t, max(shape.n_kv_heads // t, 1))
    experts(shape, layout)
