"""Flat units: the parameters of one module group laid out in one padded buffer, sharded.

A unit's parameters are concatenated into a flat buffer padded to a multiple of the
data-parallel size N; rank i owns the i-th of N equal slices. Every collective of ZeRO is
then one call on contiguous memory: reduce-scatter a unit's gradients, all-gather its
parameters. Parameters that take weight decay come first, so a rank's slice splits into at
most two runs (decayed, not decayed) and the optimizer needs no per-element mask.

The model's parameters stay ordinary ``nn.Parameter`` objects; their ``.data`` become views
into the unit's flat buffer. Freeing a gathered unit (ZeRO-3) shrinks the buffer's storage
to zero bytes and gathering grows it back, so those views, and the tensors autograd saved
for backward, stay valid across free and gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FlatUnit:
    """One unit's parameters in a flat, padded, sharded buffer."""

    name: str
    """Human name of the unit (e.g. 'layers.3')."""
    params: list[nn.Parameter]
    """Its parameters, decayed ones first; ``.data`` of each is a view into ``flat``."""
    names: list[str]
    """Fully qualified names of ``params`` in the model."""
    offsets: list[int]
    """Start of each parameter in ``flat``."""
    numel: int
    """Elements of all parameters (without padding)."""
    decay_numel: int
    """Elements ``[0, decay_numel)`` take weight decay, the rest do not."""
    world: int
    """Data-parallel size N."""
    rank: int
    """This rank's position on the data-parallel axis."""
    flat: torch.Tensor
    """The full (gathered) parameters, padded to a multiple of N. On the meta device for a
    ZeRO-3 unit built from a meta model until its first gather: it never held them."""
    device: torch.device
    """Where the unit's tensors live."""

    @property
    def padded(self) -> int:
        return self.flat.numel()

    @property
    def shard_size(self) -> int:
        return self.padded // self.world

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_size, (self.rank + 1) * self.shard_size

    @property
    def gathered(self) -> bool:
        return not self.flat.is_meta and self.flat.untyped_storage().nbytes() > 0

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a unit-sized flat tensor (a view)."""
        start, end = self.shard_range
        return flat[start:end]

    def decay_split(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a shard-sized tensor: the elements that take weight decay, the rest."""
        start, end = self.shard_range
        cut = min(max(self.decay_numel - start, 0), end - start)
        return shard[:cut], shard[cut:]

    def free(self) -> None:
        """Release the gathered parameters' memory; the views remain, pointing at nothing."""
        if not self.flat.is_meta:
            self.flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give the flat buffer its memory back (contents undefined until gathered). A unit
        built on meta gets its buffer here, once, and its parameters become views of it."""
        if self.flat.is_meta:  # real but storageless parameters until now: .data keeps hooks
            self.flat = torch.empty(self.padded, dtype=self.flat.dtype, device=self.device)
            for p, o in zip(self.params, self.offsets):
                p.data = self.flat[o:o + p.numel()].view_as(p)
            return
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.flat.element_size())

    def copy_out(self, flat_grad: torch.Tensor) -> list[torch.Tensor]:
        """Views of a unit-sized flat tensor shaped like each parameter."""
        return [flat_grad[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]


def build_unit(name: str, named_params: list[tuple[str, nn.Parameter]], world: int, rank: int,
               dtype: torch.dtype | None = None, device: torch.device | None = None,
               sharded: bool = False) -> FlatUnit:
    """Move ``named_params`` into one flat buffer (of ``dtype``, default theirs) and make
    each parameter a view into it. Meta parameters (a model built without storage) get a
    zeroed buffer on ``device``; with ``sharded`` (ZeRO-3) none at all until the unit is
    first gathered, so that building never holds a whole unit."""
    ordered = sorted(named_params, key=lambda item: item[1].ndim < 2)  # stable: decayed first
    params = [p for _, p in ordered]
    dtype = dtype or params[0].dtype
    meta = params[0].is_meta
    device = torch.device(device or params[0].device)
    numel = sum(p.numel() for p in params)
    padded = -(-numel // world) * world
    lazy = meta and sharded
    flat = torch.zeros(padded, dtype=dtype, device="meta" if lazy else device)
    offsets, offset = [], 0
    for p in params:
        if not meta:
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        offsets.append(offset)
        offset += p.numel()
    for p, o in zip(params, offsets):
        adopt(p, _storageless(p, device) if lazy else flat[o:o + p.numel()].view_as(p))
    decay_numel = sum(p.numel() for p in params if p.ndim >= 2)
    return FlatUnit(name, params, [n for n, _ in ordered], offsets, numel, decay_numel,
                    world, rank, flat, device)


def adopt(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make ``param`` (the same object: hooks and side tables key it) hold ``tensor``. A
    meta parameter cannot take real ``.data``, so its contents are swapped instead, which
    drops its hooks: call this before any are registered."""
    if param.is_meta and not tensor.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))
    else:
        param.data = tensor


def _storageless(param: nn.Parameter, device: torch.device) -> torch.Tensor:
    """A tensor of ``param``'s shape on ``device`` whose storage holds no bytes (briefly
    one parameter's, never a unit's)."""
    t = torch.empty(param.shape, dtype=param.dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def unit_params(module: nn.Module, apart: frozenset = frozenset()) -> list[nn.Parameter]:
    """The trainable parameters a unit of ``module`` holds: not those of modules in
    ``apart`` inside it (units of their own, ``units.default_units``), and not frozen ones
    (kept whole on every rank: nothing shards what never changes)."""
    if module in apart:
        return [p for p in module.parameters() if p.requires_grad]
    inner = {p for m in module.modules() if m in apart for p in m.parameters()}
    return [p for p in module.parameters() if p.requires_grad and p not in inner]


def group_units(model: nn.Module, unit_modules: list[tuple[str, list[nn.Module]]],
                apart: frozenset = frozenset()) -> list[tuple[str, list[tuple[str, nn.Parameter]]]]:
    """The named parameters of each unit, each parameter in exactly one unit.

    ``unit_modules`` lists (unit name, modules); every trainable parameter of ``model``
    must belong to exactly one unit (``unit_params``: modules in ``apart`` are units of
    their own). A parameter the modules of one unit share (a tied embedding and
    output projection, ``units.merge_shared``) is taken once; one shared between units is
    an error.
    """
    name_of = {p: n for n, p in model.named_parameters()}
    owner: dict[nn.Parameter, str] = {}
    units = []
    for unit_name, modules in unit_modules:
        named = []
        for module in modules:
            for p in unit_params(module, apart):
                if owner.get(p) == unit_name and any(p is q for _, q in named):
                    continue  # tied within the unit: one copy
                if p in owner:
                    raise ValueError(f"parameter {name_of[p]} is shared by units {owner[p]} "
                                     f"and {unit_name}; ZeRO shards each parameter once (untie it)")
                owner[p] = unit_name
                named.append((name_of[p], p))
        units.append((unit_name, named))
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in owner]
    if missing:
        raise ValueError(f"parameters {missing} belong to no ZeRO unit")
    return units


def allocate(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter of ``module`` zeroed storage on ``device``, keeping the
    ``Parameter`` objects (tensor parallelism and the optimizer key them). Zeros, not
    garbage: vocabulary padding rows lie outside every source and must stay zero."""
    for p in module.parameters():
        if p.is_meta:
            adopt(p, torch.zeros(p.shape, dtype=p.dtype, device=device))
    for name, b in module.named_buffers():
        if b.is_meta:
            raise ValueError(f"buffer {name} has no storage: compute it on the device before "
                             f"parallelizing a model built on meta (GPT.init_buffers)")
