"""Which pieces of the plain model's tensors a rank holds, for sharded checkpoints.

A *piece* is a box (a hyperrectangle: offsets and extents per dimension) of one global
tensor (a parameter or one of its Adam moments, under the plain model's name), together
with a view of the rank's live storage that holds exactly that box. Saving writes the
views; loading copies into them. Nothing is gathered and nothing is copied whole.

Where a rank's local tensor sits in the global one (its *placement*):

* replicated engine: the whole parameter, or under tensor parallelism its shard along
  ``ShardSpec.dim`` (vocabulary padding rows lie outside the global tensor and are cut);
* ZeRO: the rank owns a range of each unit's flat buffer, which covers a flat range of
  some parameters (or of their TP shards). A flat range of a box splits into at most
  2 x ndim - 1 boxes (a partial first row, whole rows, a partial last row; recursively),
  so ZeRO pieces are boxes too.

Ownership: for saving, each box of each tensor is written by exactly one rank: data-parallel
replicas (the replicated engine) write on rank 0 of their group, TP-replicated parameters
(norms; K/V heads shared by ``copies`` ranks) on the first rank holding them, pipeline stages
their own parameters. For loading every rank takes every piece it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm import collectives as C
from ..optim import adam_step_count
from ..parallel.engine import MOMENTS, plain_name, source_name

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, extents)


@dataclass
class Piece:
    """One box of one global tensor, and where it lives on this rank."""

    key: str
    """'param/<name>', 'exp_avg/<name>', 'exp_avg_sq/<name>' or 'compress/<key>'."""
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offsets: tuple[int, ...]
    """Where the box starts in the whole tensor."""
    local: torch.Tensor | None
    """The box: a view of live storage; None for a moment that does not exist yet (zeros)."""
    extents: tuple[int, ...]
    """The box's extents (``local.shape`` when there is a view)."""
    dtype: torch.dtype


@dataclass(frozen=True)
class Placement:
    """Where a rank's local tensor (of ``local_shape``) sits in the global tensor."""

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    valid: tuple[int, ...]
    """Extents of the local tensor that belong to the global one (less than the local shape
    along a padded vocabulary)."""
    owner: bool
    """Whether this rank writes it (one rank among the TP ranks holding the same data)."""


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes of a row-major tensor of ``shape`` that together hold its flat elements
    ``[start, stop)``, in order."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    (r0, o0), (r1, o1) = divmod(start, inner), divmod(stop, inner)
    rest = shape[1:]
    if r0 == r1:
        return [((r0, *off), (1, *ext)) for off, ext in flat_boxes(rest, o0, o1)]
    boxes: list[Box] = []
    if o0:
        boxes += [((r0, *off), (1, *ext)) for off, ext in flat_boxes(rest, o0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if o1:
        boxes += [((r1, *off), (1, *ext)) for off, ext in flat_boxes(rest, 0, o1)]
    return boxes


def intersect(a: Box, b: Box) -> Box | None:
    """The box two boxes share, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + e, y + f) for x, e, y, f in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def placement(param: torch.Tensor, tp) -> Placement:
    """Where ``param`` (this rank's tensor) sits in the plain model's tensor."""
    shape = tuple(param.shape)
    spec = tp.specs.get(param) if tp is not None else None
    if spec is None:  # whole (replicated over TP, if any): the first TP rank writes it
        return Placement(shape, (0,) * len(shape), shape, tp is None or C.rank(tp.group) == 0)
    rank = C.rank(tp.group)
    d, local = spec.dim, shape[spec.dim]
    start = (rank // spec.copies) * local
    full = list(shape)
    full[d] = spec.full_size
    offsets = [0] * len(shape)
    offsets[d] = start
    valid = list(shape)
    valid[d] = max(0, min(local, spec.full_size - start))
    return Placement(tuple(full), tuple(offsets), tuple(valid), rank % spec.copies == 0)


def box_pieces(key: str, local_shape: tuple[int, ...], place: Placement, start: int, stop: int,
               source: torch.Tensor | None, dtype: torch.dtype) -> list[Piece]:
    """Pieces of the flat range ``[start, stop)`` of a local tensor; ``source`` is the 1-D
    storage of exactly that range (None: zeros), cut to the part inside the global tensor."""
    out, pos = [], 0
    for off, ext in flat_boxes(local_shape, start, stop):
        n = math.prod(ext)
        view = source[pos:pos + n].view(ext) if source is not None else None
        pos += n
        kept = intersect((off, ext), ((0,) * len(off), place.valid)) if off else (off, ext)
        if kept is None:
            continue  # vocabulary padding
        if view is not None:
            for dim, (e, k) in enumerate(zip(ext, kept[1])):
                if k < e:
                    view = view.narrow(dim, 0, k)
        offsets = tuple(g + o for g, o in zip(place.offsets, off))
        out.append(Piece(key, place.shape, offsets, view, kept[1], dtype))
    return out


def expert_placement(param: torch.Tensor, ep, tp, replicated: bool = True) -> Placement:
    """Where this rank's experts sit in the stacked tensor of all of them (dim 0). They
    are whole on every tensor-parallel rank, the first of which writes them; among the
    ranks holding the same experts, the first too where they are ``replicated`` (DDP),
    each its own range where not (ZeRO)."""
    shape = tuple(param.shape)
    full = (ep.specs[param].full_size, *shape[1:])
    owner = (tp is None or C.rank(tp.group) == 0) and (not replicated or C.rank(ep.data_group) == 0)
    return Placement(full, (ep.offset(param), *(0,) * (len(shape) - 1)), shape, owner)


def replicated_pieces(engine, for_save: bool) -> list[Piece]:
    """Pieces of a ReplicatedEngine (DDP, optionally TP, pipeline stages and experts split
    over ranks)."""
    ep = getattr(engine, "ep", None)
    first_replica = C.rank(engine.dp.group) == 0
    if for_save and not first_replica and ep is None:
        return _rank_pieces(engine)
    pieces = []
    for name, p in engine.module.named_parameters():
        expert = ep is not None and ep.is_expert(p)
        place = expert_placement(p, ep, engine.tp) if expert else placement(p, engine.tp)
        if for_save and not (place.owner and (expert or first_replica)) or for_save and _copy(engine, name):
            continue
        # bf16 parameters: the fp32 master is the exact one (saved, and loaded into)
        exact = engine.optimized(p) if p.requires_grad else p
        state = engine.optimizer.state.get(exact, {})
        for kind in ("param", *MOMENTS) if p.requires_grad else ("param",):  # frozen: no moments
            source = exact.detach() if kind == "param" else state.get(kind)
            flat = source.reshape(-1) if source is not None else None
            pieces += box_pieces(f"{kind}/{source_name(name, engine.plan)}", tuple(p.shape), place, 0, p.numel(),
                                 flat, exact.dtype if kind == "param" else torch.float32)
    return pieces + (_rank_pieces(engine) if for_save else [])


def zero_pieces(engine, for_save: bool) -> list[Piece]:
    """Pieces of a ZeroDataParallel engine: each rank's range of every flat unit (for
    loading under stages 1 and 2, whose ranks hold full parameters, the whole unit).
    Where the optimizer keeps fp32 master weights (bf16 weights, offload), the parameter's
    range is the master's: a checkpoint of the bf16 copy would round every resume."""
    optimizer, pieces = engine.optimizer, []
    state = optimizer.optimizer.state
    for i, (unit, views) in enumerate(zip(engine.units, optimizer.unit_views)):
        if for_save and not unit.expert and engine.replica_group is not None and \
                C.rank(engine.replica_group) != 0:
            continue  # HSDP: the first of the ranks holding this shard writes it
        flat = unit.flat
        start, end = flat.shard_range
        shard = unit.shard if unit.shard is not None else flat.own_slice(flat.flat)
        exact = optimizer.masters[i] if optimizer.master_copy else shard
        cut = len(flat.decay_split(shard)[0])
        segments = [(a, b) for a, b in ((0, cut), (cut, flat.shard_size)) if b > a]  # as views
        for name, p, offset in zip(flat.names, flat.params, flat.offsets):
            place = (expert_placement(p, engine.expert, engine.tp, replicated=False) if unit.expert
                     else placement(p, engine.tp))
            if for_save and (not place.owner or _copy(engine, name)):
                continue
            lo, hi = max(offset, start), min(offset + p.numel(), end)
            key = source_name(name, engine.plan)
            full = not for_save and engine.stage < 3  # the full parameter lives on every rank
            if full:
                pieces += box_pieces(f"param/{key}", tuple(p.shape), place, 0, p.numel(),
                                     flat.flat[offset:offset + p.numel()], flat.flat.dtype)
            if lo < hi and (not full or exact is not shard):
                pieces += box_pieces(f"param/{key}", tuple(p.shape), place, lo - offset, hi - offset,
                                     exact[lo - start:hi - start], exact.dtype)
            if lo >= hi:
                continue
            (a, _), view = next(((a, b), v) for (a, b), v in zip(segments, views) if a <= lo - start < b)
            for kind in MOMENTS:
                moment = state.get(view, {}).get(kind)
                source = moment[lo - start - a:hi - start - a] if moment is not None else None
                pieces += box_pieces(f"{kind}/{key}", tuple(p.shape), place, lo - offset, hi - offset,
                                     source, torch.float32)
    return pieces + _frozen_pieces(engine, for_save) + (_rank_pieces(engine) if for_save else [])


def _frozen_pieces(engine, for_save: bool) -> list[Piece]:
    """ZeRO's frozen parameters, whole on every rank (in no unit): the first replica
    writes them."""
    if for_save and C.rank(engine.group) != 0:
        return []
    names = {p: n for n, p in engine.module.named_parameters()}
    pieces = []
    for p in engine.frozen:
        place = placement(p, engine.tp)
        if not for_save or place.owner:
            pieces += box_pieces(f"param/{source_name(names[p], engine.plan)}", tuple(p.shape), place,
                                 0, p.numel(), p.detach().reshape(-1), p.dtype)
    return pieces


def _copy(engine, name: str) -> bool:
    """Whether ``name`` is the last stage's copy of a tied embedding: loaded from the
    embedding's slices, never saved (parallel/pipeline/tied.py)."""
    return source_name(name, engine.plan) != plain_name(name)


def _rank_pieces(engine) -> list[Piece]:
    """This rank's own state (the reducer's error-feedback residuals, PowerSGD's Q; the
    Adam moments of ``:update``), stored whole under 'compress/METHOD/PLACE/...'
    (``Engine.rank_state``)."""
    return [Piece(f"compress/{k}", tuple(v.shape), (0,) * v.dim(), v.detach(), tuple(v.shape), v.dtype)
            for k, v in engine.rank_state().items()]


def engine_pieces(engine, for_save: bool) -> list[Piece]:
    """The pieces this rank writes (``for_save``) or reads (every piece it holds)."""
    if hasattr(engine, "units"):
        return zero_pieces(engine, for_save)
    return replicated_pieces(engine, for_save)


@torch.no_grad()
def prepare_optimizer_state(engine, step: int) -> None:
    """Adam state after ``step`` steps for every tensor the optimizer updates, with moments
    for loading to copy into."""
    if hasattr(engine, "units"):
        optimizer = engine.optimizer.optimizer
        targets = [v for views in engine.optimizer.unit_views for v in views]
    else:
        optimizer = engine.optimizer
        targets = [engine.optimized(p) for p in engine.module.parameters() if p.requires_grad]
    for t in targets:  # moments that exist are reused (loading overwrites every element)
        old = optimizer.state.get(t, {})
        optimizer.state[t] = {"step": adam_step_count(optimizer, step, t.device),
                              **{k: old[k] if k in old else torch.zeros_like(t, dtype=torch.float32)
                                 for k in MOMENTS}}


@torch.no_grad()
def after_load(engine) -> None:
    """Refresh what derives from the loaded parameters: the weights ZeRO computes with,
    from the fp32 master copies it loaded (zero_pieces)."""
    optimizer = getattr(engine, "optimizer", None)
    if hasattr(engine, "units") and optimizer.master_copy:
        for shard, master in zip(optimizer.shards, optimizer.masters):
            shard.copy_(master)
    elif getattr(engine, "masters", None) is not None:  # DDP's bf16 parameters
        engine.masters.write_back()
