"""Per-unit runtime state of ZeRO: gradient buffers and in-flight collectives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup
from ...comm.reducer import GradReducer
from ...comm import collectives as C
from .flat import FlatUnit, adopt, build_unit, group_units, unit_params


def default_units(model: nn.Module, prefix: str = "", apart: frozenset = frozenset()
                  ) -> list[tuple[str, nn.Module]]:
    """The modules whose parameters ZeRO communicates together, in the order the model runs
    them: one unit per element of a module list (the transformer blocks) and one per other
    child that has parameters (embedding, final norm, head). Containers of such models (a
    pipeline rank's chunks) are unpacked the same way. A module in ``apart`` (a block's
    experts, sharded over another group) is a unit of its own, listed after the unit that
    contains it, which keeps the rest of its parameters (``group_units``)."""
    units = []
    for name, child in model.named_children():
        path = prefix + name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for key, element in child.named_children():
                units += _unit_or_parts(element, f"{path}.{key}", apart)
        else:
            units += _unit_or_parts(child, path, apart)
    return units


def merge_shared(units: list[tuple[str, nn.Module]], apart: frozenset = frozenset()
                 ) -> list[tuple[str, list[nn.Module]]]:
    """``units`` with every module that shares a parameter with an earlier unit (a tied
    output projection: the token embedding's matrix) joined to that unit: ZeRO keeps each
    parameter in one flat buffer, gathered for every module that uses it."""
    merged: list[tuple[str, list[nn.Module]]] = []
    owner: dict[nn.Parameter, int] = {}
    for name, module in units:
        params = unit_params(module, apart)
        shared = {owner[p] for p in params if p in owner}
        if len(shared) > 1:
            raise ValueError(f"{name} shares parameters with {len(shared)} other ZeRO units; "
                             f"ZeRO joins a module to at most one unit it shares with")
        if shared:
            at = shared.pop()
            merged[at] = (f"{merged[at][0]}+{name}", [*merged[at][1], module])
        else:
            at = len(merged)
            merged.append((name, [module]))
        owner.update({p: at for p in params})
    return merged


def _unit_or_parts(module: nn.Module, path: str, apart: frozenset) -> list[tuple[str, nn.Module]]:
    if any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in module.children()):
        return default_units(module, path + ".", apart)
    if not any(p.requires_grad for p in module.parameters()):
        return []
    inner = [(f"{path}.{name}", m) for name, m in module.named_modules() if m in apart and name]
    return [(path, module), *inner]


@dataclass
class Unit:
    """A flat unit plus the module that runs it and its gradient state."""

    flat: FlatUnit
    """Parameters, flat and sharded."""
    modules: list[nn.Module]
    """The modules whose forward uses them (ZeRO-3 hooks each): one, or two for a tied
    embedding and output projection."""
    index: int = 0
    """Its place among its reducer's units (the reducer keeps each unit's state by it)."""
    expert: bool = False
    """Holds experts: sharded and averaged over the expert-data-parallel group, after a
    scale of 1 / ep (parallel/expert.py); otherwise over the data-parallel group."""
    shard: torch.Tensor | None = None
    """Stage 3: this rank's parameter slice, the only copy kept between uses."""
    flat_grad: torch.Tensor | None = None
    """Stage 1: full gradients (params' .grad are views). Stages 2/3: the temporary flat
    gradient being assembled during backward."""
    grad_shard: torch.Tensor | None = None
    """This rank's averaged gradient slice (stage 1: a view into flat_grad)."""
    ready: set[torch.Tensor] = field(default_factory=set)
    """The parameters whose gradient this backward produced."""
    keeps_full_grad: bool = False
    """Stage 1: the full gradient persists and the shard is a view of it; stages 2/3
    assemble it temporarily and add their slice to a separate shard."""
    launched: bool = False
    """Its reduction was launched in this backward pass."""
    reduce_work: object | None = None
    """The in-flight average of the gradient (a ``Pending``)."""
    gather_work: object | None = None
    """Handle of the in-flight all-gather (stage 3)."""

    def __post_init__(self) -> None:
        self._offset_of = {p: o for p, o in zip(self.flat.params, self.flat.offsets)}

    def setup_grads(self, stage: int) -> None:
        flat = self.flat
        self.keeps_full_grad = stage == 1
        if stage == 1:
            self.flat_grad = torch.zeros_like(flat.flat)
            for p, view in zip(flat.params, flat.copy_out(self.flat_grad)):
                p.grad = view
            self.grad_shard = flat.own_slice(self.flat_grad)
        else:
            self.grad_shard = torch.zeros(flat.shard_size, dtype=flat.flat.dtype, device=flat.device)

    def stash_grad(self, param: nn.Parameter) -> None:
        """Stages 2/3: add ``param.grad`` into the unit's temporary flat gradient and drop it
        (added, so that backwards under ``no_sync`` accumulate there)."""
        if self.flat_grad is None:
            self.flat_grad = self.grad_shard.new_zeros(self.flat.padded)
        offset = self._offset_of[param]
        self.flat_grad[offset:offset + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None

    def start_reduce(self, reducer: GradReducer, scale: float = 1.0) -> None:
        """Hand the unit's gradient, times ``scale``, to its reducer; this rank's slice of
        the average lands in place."""
        if self.flat_grad is None:  # no parameter of the unit got a gradient
            self.flat_grad = self.grad_shard.new_zeros(self.flat.padded)
        if scale != 1.0:
            self.flat_grad.mul_(scale)
        self.reduce_work = reducer.average_shard(self.index, self.flat_grad,
                                                 self.flat.own_slice(self.flat_grad))
        self.launched = True

    def finish_reduce(self) -> None:
        self.reduce_work.wait()
        self.reduce_work = None
        if not self.keeps_full_grad:
            self.grad_shard += self.flat.own_slice(self.flat_grad)  # accumulate microbatches
            self.flat_grad = None  # the full gradient is never kept

    def zero_grads(self) -> None:
        (self.flat_grad if self.keeps_full_grad else self.grad_shard).zero_()

    def grad_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.flat_grad, self.grad_shard) if t is not None]


def build_units(module: nn.Module, group: ProcessGroup, stage: int,
                 param_dtype: torch.dtype | None, device: torch.device, expert=None) -> list[Unit]:
    """``module``'s units as flat buffers over ``group`` (its experts' over ``expert``'s
    data group); at stage 3 each keeps only its shard (the flat buffer freed until
    gathered)."""
    apart = frozenset(expert.modules if expert is not None else ())
    unit_modules = merge_shared(default_units(module, apart=apart), apart)
    named = group_units(module, unit_modules, apart)
    units = []
    for (name, params), (_, modules) in zip(named, unit_modules):
        is_expert = expert is not None and expert.is_expert(params[0][1])
        over = expert.data_group if is_expert else group
        flat = build_unit(name, params, C.size(over), C.rank(over), param_dtype, device,
                          sharded=stage == 3)
        units.append(Unit(flat, modules, index=sum(u.expert == is_expert for u in units),
                          expert=is_expert))
    for unit in units:
        unit.setup_grads(stage)
        if stage == 3:
            flat = unit.flat
            unit.shard = (flat.own_slice(flat.flat).clone() if not flat.flat.is_meta else
                          torch.zeros(flat.shard_size, dtype=flat.flat.dtype, device=flat.device))
            flat.free()
    return units


def make_reducer(units: list[Unit], group: ProcessGroup, spec, ring: bool | None) -> GradReducer:
    """The average of ``units``' gradients over ``group`` (indexed by ``Unit.index``)."""
    return GradReducer(spec, [(list(zip(u.flat.offsets, [p.shape for p in u.flat.params])), u.flat.padded)
                              for u in units], group, device=units[0].flat.device if units else None,
                       names=[u.flat.names for u in units], ring=ring)


def allocate(params: list[nn.Parameter], device: torch.device) -> None:
    """Zeroed storage on ``device`` for those of ``params`` built on meta."""
    for p in params:
        if p.is_meta:
            adopt(p, torch.zeros(p.shape, dtype=p.dtype, device=device))
