"""Expert parallelism: each mixture-of-experts layer's experts split over an expert group
folded onto the data-parallel ranks, tokens sent to their experts by all-to-all.

Every rank routes its own tokens. ``AllToAllDispatch`` (which replaces the block's local
dispatch, ``models/moe.py``) then

1. exchanges the count of rows each rank sends to each expert (one all-to-all of
   n_experts integers), so every rank knows the sizes it receives: dropless, any size,
   empty parts included;
2. sends the rows, sorted by expert, to the ranks holding those experts;
3. runs its local experts on the rows it received, regrouped by expert (one grouped GEMM
   on CUDA, ``models.moe.run_experts``);
4. sends the results back by the reverse all-to-all, where the router's weights combine
   them.

Every rank calls both all-to-alls in every MoE layer of every microbatch, even with no
rows to send or receive: skipping an empty exchange would hang the others.

Gradients. A rank's experts receive gradient from the tokens of its whole expert group,
each rank's loss scaled by |G| / N (G: the dp x cp ranks, docs/data-parallel.md). The
expert-data-parallel group (the ranks holding the same experts, dp / ep of them) then
averages, which leaves ep times the global batch's gradient: expert gradients are scaled
by 1 / ep before that average (``DataParallel``'s expert buckets).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..comm.autograd import all_to_all_v
from .tensor import ShardSpec


class AllToAllDispatch(nn.Module):
    """The experts' outputs for rows sorted by expert, the experts spread over ``group``
    (this rank holds ``experts``, a contiguous 1 / ep of them)."""

    def __init__(self, group: ProcessGroup, n_experts: int, name: str = ""):
        super().__init__()
        self.group, self.n_experts = group, n_experts
        self.name = name
        """The MoE layer's path in the plain model (``layers.3.mlp``): a hang names it."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        watch_label = f"mixture-of-experts layer {self.name}"  # read by the watchdog (watchdog.py)
        ep = C.size(self.group)
        local = self.n_experts // ep
        received = torch.empty_like(counts)
        C.all_to_all(received, counts.contiguous(), self.group)  # my experts' counts, by source
        per = received.view(ep, local)  # (source rank, local expert)
        send, recv = counts.view(ep, local).sum(1).tolist(), per.sum(1).tolist()
        x = all_to_all_v(rows, recv, send, self.group, watch_label)
        order = _expert_major(per)
        y = experts(x[order], per.sum(0).tolist())
        y = y.new_zeros(y.shape).index_copy(0, order, y)  # back to source-major order
        return all_to_all_v(y, send, recv, self.group, watch_label)


class SplitSequences(nn.Module):
    """Each sequence's tokens per expert, summed over ``groups``: the ranks holding the
    other parts of this rank's sequences (cp; tp under sequence parallelism). Counts carry
    no gradient, so a plain all-reduce."""

    def __init__(self, groups: tuple[ProcessGroup, ...]):
        super().__init__()
        self.groups = groups
        self.parts = math.prod(C.size(g) for g in groups)

    def forward(self, per_seq: torch.Tensor) -> torch.Tensor:
        total = per_seq.detach().clone()
        for group in self.groups:
            C.all_reduce(total, group)
        return total


def split_sequences(model: nn.Module, description, groups: tuple[ProcessGroup, ...]) -> None:
    """Make every MoE block of ``model`` count its routing per whole sequence over
    ``groups`` (the seam ``models/moe.py`` calls ``sequences``)."""
    for block in model.get_submodule(description.blocks):
        if description.has_experts(block):
            block.set_submodule(description.sequences, SplitSequences(groups))


def _expert_major(per: torch.Tensor) -> torch.Tensor:
    """Row order regrouping rows received source by source (each source's rows sorted by
    expert) into expert by expert."""
    sizes = per.flatten().tolist()
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    ep, local = per.shape
    spans = [torch.arange(starts[s * local + e], starts[s * local + e] + sizes[s * local + e])
             for e in range(local) for s in range(ep)]
    return torch.cat(spans).to(per.device) if spans else per.new_zeros(0)


class ExpertParallel:
    """What ``apply_expert_parallel`` did: which parameters are this rank's experts, and
    the groups their tokens and gradients travel over."""

    def __init__(self, group: ProcessGroup, data_group: ProcessGroup):
        self.group = group
        """The expert-parallel group (ranks exchanging tokens)."""
        self.data_group = data_group
        """The ranks holding the same experts (their gradients are averaged over it)."""
        self.specs: dict[nn.Parameter, ShardSpec] = {}
        """Each expert parameter's split: dim 0 (the experts), full size n_experts."""
        self.modules: list[nn.Module] = []
        """Each MoE block's experts (ZeRO makes each a unit of its own, over ``data_group``)."""

    @property
    def size(self) -> int:
        return C.size(self.group)

    def is_expert(self, param: nn.Parameter) -> bool:
        return param in self.specs

    def offset(self, param: nn.Parameter) -> int:
        """This rank's first expert in the full tensor."""
        return C.rank(self.group) * param.shape[0]

    def local_shard(self, param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor of ``param``'s shape (moments, weights)."""
        start = self.offset(param)
        return full[start:start + param.shape[0]].clone()

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of an expert parameter (or of its gradient) from every rank's
        slice (collective over the expert group)."""
        full = torch.empty((self.size * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                           device=local.device)
        C.all_gather(full, local.detach().contiguous(), self.group)
        return full


def apply_expert_parallel(model: nn.Module, description, group: ProcessGroup,
                          data_group: ProcessGroup) -> ExpertParallel:
    """Keep this rank's 1 / ep of every MoE block's experts and route its tokens through
    ``AllToAllDispatch``; dense blocks are untouched."""
    ep, rank = C.size(group), C.rank(group)
    result = ExpertParallel(group, data_group)
    for index, block in enumerate(model.get_submodule(description.blocks)):
        if not description.has_experts(block):
            continue
        experts = block.get_submodule(description.experts)
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        n_experts = getattr(experts, names[0]).shape[0]
        if n_experts % ep:
            raise ValueError(f"{n_experts} experts cannot be split over ep={ep} ranks")
        local = n_experts // ep
        result.modules.append(experts)
        for name in names:
            full = getattr(experts, name)
            with torch.no_grad():  # a copy: the whole tensor's storage is freed
                part = full[rank * local:(rank + 1) * local].clone()
            shard = nn.Parameter(part, requires_grad=full.requires_grad)
            setattr(experts, name, shard)
            result.specs[shard] = ShardSpec(dim=0, full_size=n_experts)
        layer = f"{description.blocks}.{index}.{description.experts.rpartition('.')[0]}"
        block.set_submodule(description.dispatcher, AllToAllDispatch(group, n_experts, layer))
    return result
