"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) for a plain model, after it is built,
through its description (``models/description.py``): a table of (module path, style) per
block and for the embedding and head, and the regions, applied by one loop.

Every weight matrix of a transformer block is split across the ``t`` ranks of the
tensor-parallel group so that each block needs one collective in forward and one in
backward:

* attention: ``wq``/``wk``/``wv`` split by heads (column-parallel: each rank computes whole
  heads), ``wo`` split by its input rows (row-parallel: each rank's heads give a partial sum);
* MLP: ``w1``/``w3`` column-parallel, ``w2`` row-parallel;
* token embedding split over the vocabulary; the output projection column-parallel over
  the vocabulary, followed by a cross-entropy that never gathers the full logits.

The layers here only hold their shard and multiply; the communication sits at the
block's entry (operator f, or an all-gather under sequence parallelism) and exit
(operator g, or a reduce-scatter), see ``paratrain.comm.autograd`` and
``paratrain.parallel.sequence``. Each shard is sliced from the unsharded model's
initialisation, so a tp=t model starts exactly where the single-process one does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from .. import rules
from ..comm import collectives as C
from ..models.description import ModelDescription, Style, describe
from .sequence import Regions
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, padded_size, shard_rows


class ColumnParallelLinear(nn.Module):
    """y_i = x A_i^T: this rank's slice of the output features (rows of the weight).

    Built from an unsharded ``nn.Linear`` by keeping piece ``shard`` of ``num_shards`` equal
    row blocks (default: this rank's piece of ``size(group)``); ``padded_out`` zero-pads the
    output features first (a vocabulary not divisible by t). The input must already be
    replicated on every rank (after f, or after the sequence all-gather).
    """

    def __init__(self, linear: nn.Linear, group: ProcessGroup, num_shards: int | None = None,
                 shard: int | None = None, padded_out: int | None = None):
        super().__init__()
        num_shards = num_shards or C.size(group)
        shard = C.rank(group) if shard is None else shard
        padded = padded_out or linear.out_features
        if padded % num_shards:
            raise ValueError(f"{linear.out_features} output features (padded to {padded}) cannot be "
                             f"split into {num_shards} equal column shards")
        self.in_features = linear.in_features
        self.full_out_features = linear.out_features
        self.weight = nn.Parameter(shard_rows(linear.weight, num_shards, shard, padded))
        self.out_features = self.weight.shape[0]
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(shard_rows(linear.bias, num_shards, shard, padded))
        self._handed: tuple[torch.Tensor, torch.Tensor] | None = None

    def hand_over(self, entered: torch.Tensor, out: torch.Tensor) -> None:
        """The region's entry computed this layer's output on ``entered`` (with the GEMMs
        sharing that input, see ``sequence.EnterColumnParallel``): the next call on
        ``entered`` returns it."""
        self._handed = (entered, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        handed, self._handed = self._handed, None
        if handed is not None and handed[0] is x:
            return handed[1]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} of {self.full_out_features}"


class RowParallelLinear(nn.Module):
    """y = sum_i x_i B_i^T: this rank's slice of the input features (columns of the weight).

    The input is the matching slice produced by a column-parallel layer; the output is a
    partial sum that the block's exit operator (all-reduce or reduce-scatter) completes.
    """

    def __init__(self, linear: nn.Linear, group: ProcessGroup):
        super().__init__()
        t = C.size(group)
        if linear.bias is not None:
            raise ValueError("RowParallelLinear does not support a bias: it would be added once per "
                             "rank before the reduction; build the layer with bias=False")
        if linear.in_features % t:
            raise ValueError(f"{linear.in_features} input features cannot be split evenly "
                             f"over tp={t}; choose a tp that divides them")
        self.full_in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().chunk(t, dim=1)[C.rank(group)].clone())
        self.in_features = self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features} of {self.full_in_features}, out={self.out_features}"




@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tensor-parallel group."""

    dim: int
    """Dimension of the parameter split over the group (0: rows / vocabulary, 1: columns)."""
    full_size: int
    """Size of that dimension in the unsharded model, before vocabulary padding."""
    copies: int = 1
    """Consecutive ranks holding the same shard (KV heads replicated when kv_heads < tp)."""


class TensorParallel:
    """What ``apply_tensor_parallel`` did to a model, and what the training loop needs from it.

    Parameters fall in two kinds. *Sharded* ones hold different slices on every rank of the
    group. *Replicated* ones are the same on several ranks: the norm weights (on all of
    them) and, when kv_heads < tp, the K/V projections (on the ``copies`` ranks sharing a
    KV head). A replicated parameter whose ranks see different data gets partial gradients
    that ``sync_replicated_grads`` sums.
    """

    def __init__(self, group: ProcessGroup, sequence_parallel: bool, regions: Regions | None = None):
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.regions = regions  # the blocks' region operators (--compile keeps them eager)
        self.specs: dict[nn.Parameter, ShardSpec] = {}  # absent: replicated on all ranks
        self.hooks: list = []  # handles of the region hooks
        self.sharded_params: list[nn.Parameter] = []
        self.replicated_params: list[nn.Parameter] = []
        self._partial: list[nn.Parameter] = []  # replicated params with partial gradients
        self._hooked = False  # partial gradients summed by hooks during backward

    def shard(self, param: nn.Parameter, spec: ShardSpec) -> None:
        self.specs[param] = spec

    def adopt(self, old: nn.Parameter, new: nn.Parameter) -> None:
        """Split ``new`` as ``old`` is split (a tied embedding's copy on the last pipeline
        stage, made after this split: parallel/pipeline/tied.py)."""
        if old in self.specs:
            self.specs[new] = self.specs[old]
        for kept in (self.sharded_params, self.replicated_params, self._partial):
            kept[:] = [new if p is old else p for p in kept]

    def collect_replicated(self, model: nn.Module) -> None:
        """Sort the model's parameters into sharded and replicated ones."""
        for p in model.parameters():
            spec = self.specs.get(p)
            if spec is not None and spec.copies == 1:
                self.sharded_params.append(p)
                continue
            self.replicated_params.append(p)
            # Norms see different tokens on each rank only under SP; a replicated KV head
            # always serves different query heads on each of its copies.
            if (spec is not None or self.sequence_parallel) and p.requires_grad:  # frozen: none
                self._partial.append(p)

    def add_partial(self, param: nn.Parameter) -> None:
        """``param`` is replicated but each rank computes only its share of its gradient
        (a per-head norm, applied by each rank to its own heads): summed like SP's norms."""
        if not any(p is param for p in self._partial):  # (``in`` would compare values)
            self._partial.append(param)

    def is_sharded(self, param: nn.Parameter) -> bool:
        """True if ``param`` holds a different slice on every rank of the group."""
        spec = self.specs.get(param)
        return spec is not None and spec.copies == 1

    def owned_params(self) -> list[nn.Parameter]:
        """The parameters this rank counts in a global gradient norm: all sharded ones, and
        each replicated one on exactly one rank of the ranks holding it. Then
        ``norm = sqrt(all_reduce_tp(sum of owned squared grads))``."""
        rank = C.rank(self.group)
        owned = list(self.sharded_params)
        for p in self.replicated_params:
            spec = self.specs.get(p)
            if rank % (spec.copies if spec else C.size(self.group)) == 0:
                owned.append(p)
        return owned

    @torch.no_grad()
    def sync_replicated_grads(self) -> None:
        """Sum the partial gradients of replicated parameters over the group, in place, in
        one all-reduce. Call after the last backward of a step, before clipping and the
        optimizer step. Plain TP with kv_heads >= tp has nothing to sum: the norms see every
        token and, through f's all-reduce in backward, the full gradient of their output."""
        # Parameters of other pipeline stages were released (no elements): not ours to sum.
        partial = [p for p in self._partial if p.numel()]
        if not partial or C.size(self.group) == 1 or self._hooked:
            return
        for p in partial:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        packed = [self._pack(p, p.grad) for p in partial]
        flat = torch.cat(packed)
        C.all_reduce(flat, self.group)
        for p, summed in zip(partial, flat.split([t.numel() for t in packed])):
            p.grad.copy_(self._unpack(p, summed))

    def register_grad_sync_hooks(self) -> None:
        """Sum each partial gradient over the group as backward produces it, before it is
        accumulated into ``.grad`` (one small all-reduce per parameter and backward), for
        wrappers that consume ``.grad`` during backward (ZeRO-2/3). Call before wrapping
        the model. ``sync_replicated_grads`` then does nothing."""
        if C.size(self.group) == 1 or self._hooked:
            return
        self._hooked = True
        for p in self._partial:
            self.hooks.append(p.register_hook(lambda grad, p=p: self._sum_one(p, grad)))

    def _sum_one(self, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        packed = self._pack(p, grad).clone()
        C.all_reduce(packed, self.group)
        return self._unpack(p, packed).clone()

    def _pack(self, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` flattened for the sum over the group. A replicated KV head goes to its
        own slot (zeros in the others), so only the ranks sharing that head add up."""
        spec = self.specs.get(p)
        if spec is None:
            return grad.flatten()
        t, rank = C.size(self.group), C.rank(self.group)
        slots = grad.new_zeros(t // spec.copies, grad.numel())
        slots[rank // spec.copies] = grad.flatten()
        return slots.flatten()

    def _unpack(self, p: nn.Parameter, summed: torch.Tensor) -> torch.Tensor:
        spec = self.specs.get(p)
        if spec is None:
            return summed.view_as(p)
        return summed.view(-1, p.numel())[C.rank(self.group) // spec.copies].view_as(p)

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module, grads: bool = False,
                        local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The unsharded parameters (or their gradients) under the plain model's names, with
        the vocabulary padding removed. ``local`` supplies this rank's tensors by name when
        the parameters themselves are not materialised (ZeRO-3). Collective: every rank of
        the group must call it."""
        t = C.size(self.group)
        out = {}
        for name, p in model.named_parameters():
            value = local[name] if local is not None else (p.grad if grads else p)
            if value is None:
                value = torch.zeros_like(p)
            spec = self.specs.get(p)
            if spec is None:
                out[name] = value.detach().clone()
                continue
            front = value.detach().transpose(0, spec.dim).contiguous()
            gathered = front.new_empty(front.shape[0] * t, *front.shape[1:])
            C.all_gather(gathered, front, self.group)
            distinct = gathered.chunk(t)[::spec.copies]
            full = torch.cat(distinct)[:spec.full_size]
            out[name] = full.transpose(0, spec.dim).contiguous()
        return out


    def local_shard(self, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full``, a tensor shaped like the unsharded ``param`` (the
        inverse of ``full_state_dict`` for one tensor, e.g. an optimizer moment)."""
        spec = self.specs.get(param)
        if spec is None:
            return full.clone()
        distinct = C.size(self.group) // spec.copies
        front = full.transpose(0, spec.dim)
        padded = param.shape[spec.dim] * distinct  # vocabulary padding, if any
        if padded > front.shape[0]:
            front = torch.cat([front, front.new_zeros(padded - front.shape[0], *front.shape[1:])])
        piece = front.chunk(distinct)[C.rank(self.group) // spec.copies]
        return piece.transpose(0, spec.dim).contiguous().clone()


def _check_model(model: nn.Module, desc: ModelDescription, t: int) -> None:
    if isinstance(model.get_submodule(desc.embedding), VocabParallelEmbedding):
        raise ValueError("apply_tensor_parallel was already applied to this model")
    rules.heads(desc.shape.n_heads, desc.shape.n_kv_heads, t)
    rules.mlp_width(desc.shape.ffn_hidden, t)
    _check_shapes(model, desc)


def _check_shapes(model: nn.Module, desc: ModelDescription) -> None:
    """The description's numbers against the model's first block and its embedding: a
    wrong count of KV heads, say, would otherwise pair query heads with the wrong ones."""
    blocks = model.get_submodule(desc.blocks)
    wanted = {desc.q: (desc.shape.n_heads * desc.shape.head_dim, "n_heads x head_dim"),
              desc.k: (desc.shape.n_kv_heads * desc.shape.head_dim, "n_kv_heads x head_dim"),
              desc.v: (desc.shape.n_kv_heads * desc.shape.head_dim, "n_kv_heads x head_dim")}
    dense = next((i for i, b in enumerate(blocks) if not desc.has_experts(b)), None)
    checks = [(0, path, want) for path, want in wanted.items()]
    if dense is not None:  # an MLP to check (a mixture of experts may have none)
        checks += [(dense, path, (desc.shape.ffn_hidden, "ffn")) for path in desc.mlp_in]
    for index, path, (rows, fields) in checks:
        got = blocks[index].get_submodule(path).weight.shape[0]
        if got != rows:
            raise ValueError(f"the model description says {fields} = {rows} for {desc.blocks}.{index}."
                             f"{path}, whose weight has {got} rows: describe the model as it is built")
    vocab = model.get_submodule(desc.embedding).weight.shape[0]
    if vocab != desc.shape.vocab_size:
        raise ValueError(f"the model description says vocab_size = {desc.shape.vocab_size}, but "
                         f"{desc.embedding} has {vocab} rows: describe the model as it is built")


def _kv_split(kv_heads: int, t: int, rank: int) -> tuple[int, int, int]:
    """(num_shards, shard, copies) of the K/V projections: split by KV head when there are
    at least t of them; otherwise each rank keeps the one KV head its query heads use, and
    ``copies = t / kv_heads`` consecutive ranks hold the same head."""
    if kv_heads >= t:
        return t, rank, 1
    copies = t // kv_heads
    return kv_heads, rank // copies, copies


def _parallel_module(module: nn.Module, style: Style, tp: TensorParallel, regions: Regions,
                     desc: ModelDescription) -> tuple[nn.Module, list[tuple[nn.Parameter, ShardSpec]]]:
    """The tensor-parallel replacement of ``module`` for ``style``, and how each of its
    parameters is split."""
    group, t = tp.group, C.size(tp.group)
    if style == "vocab_embedding":
        new = VocabParallelEmbedding(module, group, regions)
        return new, [(new.weight, ShardSpec(0, desc.shape.vocab_size))]
    if style == "vocab_head":
        new = ColumnParallelLinear(module, group, padded_out=padded_size(desc.shape.vocab_size, t))
        return new, [(new.weight, ShardSpec(0, desc.shape.vocab_size))]
    if style == "rowwise":
        new = RowParallelLinear(module, group)
        return new, [(new.weight, ShardSpec(1, new.full_in_features))]
    num, shard, copies = (_kv_split(desc.shape.n_kv_heads, t, C.rank(group)) if style == "colwise_kv"
                          else (None, None, 1))
    new = ColumnParallelLinear(module, group, num, shard)
    spec = ShardSpec(0, new.full_out_features, copies)  # a bias is cut like its weight's rows
    return new, [(p, spec) for p in (new.weight, new.bias) if p is not None]


def _apply_plan(root: nn.Module, plan: list[tuple[str, Style]], tp: TensorParallel,
                regions: Regions, desc: ModelDescription) -> None:
    """Replace each module of ``plan`` (paths relative to ``root``) by its parallel form."""
    for path, style in plan:
        new, specs = _parallel_module(root.get_submodule(path), style, tp, regions, desc)
        root.set_submodule(path, new)
        for param, spec in specs:
            tp.shard(param, spec)


def _hook_region(region: nn.Module, columns: list[nn.Module], tp: TensorParallel,
                 regions: Regions, exit: bool = True) -> None:
    """The entry operator (with the column layers' GEMMs) before ``region``, the exit after."""
    tp.hooks.append(region.register_forward_pre_hook(regions.enter_hook(columns)))
    if exit:
        tp.hooks.append(region.register_forward_hook(regions.exit_hook))


def apply_tensor_parallel(model: nn.Module, tp_group: ProcessGroup, sequence_parallel: bool = False,
                          overlap_comm: bool = True,
                          description: ModelDescription | None = None) -> TensorParallel:
    """Split ``model`` in place over ``tp_group`` (Megatron TP, plus Megatron-SP when
    ``sequence_parallel``), following its description (``models/description.py``; default:
    the model's own ``description()``). Afterwards ``model(tokens, targets)`` with the same
    full (b, s) tokens and targets on every rank of the group returns the same summed loss
    as the unsharded model. ``overlap_comm`` computes the column-parallel layers' weight
    gradients while the backward collective at each region's entry runs. Call before
    wrapping in DataParallel / ZeRO."""
    desc = description or describe(model)
    _check_model(model, desc, C.size(tp_group))
    regions = Regions(tp_group, sequence_parallel, overlap_comm)
    tp = TensorParallel(tp_group, sequence_parallel, regions)
    tied = model.get_submodule(desc.head).weight is model.get_submodule(desc.embedding).weight
    _apply_plan(model, desc.model_plan(), tp, regions, desc)
    head = model.get_submodule(desc.head)
    if tied:  # both are split over the vocabulary the same way: share the one shard
        tp.specs.pop(head.weight)
        head.weight = model.get_submodule(desc.embedding).weight
    _hook_region(head, [head], tp, regions, exit=False)  # the loss reads vocabulary shards
    model.set_submodule(desc.loss, VocabParallelCrossEntropy(tp_group, desc.shape.vocab_size))
    for block in model.get_submodule(desc.blocks):
        experts = desc.has_experts(block)
        _apply_plan(block, desc.block_plan(experts), tp, regions, desc)
        for region, columns in desc.block_regions(experts):
            _hook_region(block.get_submodule(region), [block.get_submodule(c) for c in columns],
                         tp, regions)
    tp.collect_replicated(model)
    for block in model.get_submodule(desc.blocks):
        for path in desc.head_norms:
            try:
                norm = block.get_submodule(path)
            except AttributeError:  # a model without them (or with None in their place)
                continue
            for p in norm.parameters():
                tp.add_partial(p)
    return tp
