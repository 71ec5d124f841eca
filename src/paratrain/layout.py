"""Layout: how a world of ranks is cut into parallel axes. Pure rank math, no processes:
topology only (what a model shape or a strategy allows is in ``rules.py``).

A world of ``dp * pp * cp * tp`` ranks is laid out as a 4-D grid. The ``order`` string
lists the axes from fastest- to slowest-varying rank index, so with the default
``"tp-cp-pp-dp"`` tensor-parallel peers are consecutive ranks (one node, fast links) and
data-parallel replicas are the farthest apart (they communicate least often).

Example, dp=2 x tp=2 with the default order::

    rank  0   1   2   3
    tp    0   1   0   1
    dp    0   0   1   1

Domain parallelism (docs/domain-parallel.md) adds two axes, ``domh`` and ``domw``: a grid of
ranks over an image's height and width. Two plain axes rather than one axis with a grid
shape, so that a rank's row and column neighbours come from the same ``ranks_along`` math
as every other group. An order string may leave them out (every order written before
they existed does): they then vary fastest, ``domw`` first, so halo-exchanging neighbours
are consecutive ranks. ``"dom"`` names both at once (``"dp-dom"``). With both of size 1
a layout's ranks, groups and coordinates are exactly what they were without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

# Axis names: code names an axis (or a combination, for a group spanning several) by
# these constants, never by a free string.
DP, PP, CP, TP = "dp", "pp", "cp", "tp"
DOMH, DOMW = "domh", "domw"
AXES = (DP, PP, CP, TP)
DOMAIN_AXES = (DOMH, DOMW)
ALL_AXES = AXES + DOMAIN_AXES
DP_CP = (DP, CP)
"""Ranks holding the same weights and seeing different tokens: gradients average over them."""
DP_DOM = (DP, *DOMAIN_AXES)
"""Ranks holding the same weights under domain parallelism."""
DEFAULT_ORDER = "tp-cp-pp-dp"


class LayoutError(ValueError):
    """A layout that cannot work; the message names the problem and the fix."""


def _as_axes(axes: str | Iterable[str]) -> tuple[str, ...]:
    names = tuple(axes.replace(",", "-").split("-")) if isinstance(axes, str) else tuple(axes)
    names = tuple(n for name in names for n in (DOMAIN_AXES if name == "dom" else (name,)))
    for name in names:
        if name not in ALL_AXES:
            raise LayoutError(f"unknown axis {name!r}; the axes are {', '.join(ALL_AXES)} (and dom = domh-domw)")
    return names


def parse_domain(text: str | int) -> tuple[int, int]:
    """``"4"`` -> (4, 1): four ranks over the height; ``"2x2"`` -> (2, 2): height x width."""
    parts = str(text).lower().split("x")
    try:
        sizes = [int(v) for v in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes, default=0) < 1:
        raise LayoutError(f"domain={text!r}: give N (N ranks over the height) or HxW, e.g. 2x2")
    return (sizes[0], sizes[1] if len(sizes) == 2 else 1)


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel axes and how ranks map onto them."""

    dp: int = 1
    """Data-parallel replicas (each sees a different slice of the batch)."""
    pp: int = 1
    """Pipeline stages (each holds a contiguous slice of the layers)."""
    cp: int = 1
    """Context-parallel ranks (each holds a slice of the sequence)."""
    tp: int = 1
    """Tensor-parallel ranks (each holds a slice of every weight matrix)."""
    order: str = DEFAULT_ORDER
    """Axes from fastest- to slowest-varying rank index, joined by '-'."""
    domh: int = 1
    """Domain-parallel ranks over the height of each sample (spatial sharding)."""
    domw: int = 1
    """Domain-parallel ranks over the width of each sample."""
    ep: int = 1
    """Expert-parallel ranks, folded onto the data- and context-parallel ranks (not an axis
    of its own): each mixture-of-experts layer's experts are split over ep consecutive
    ranks of the dp x cp group, which exchange tokens; dense layers keep their layout."""

    shard_group: int = 0
    """ZeRO-3's hybrid sharding (HSDP), folded onto the dp x cp ranks like ep: each group of
    shard_group consecutive ones shards the states, and the ranks at the same place in
    each group hold replicas (0: one group of all of them)."""

    def __post_init__(self) -> None:
        for axis in ALL_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"{axis}={size!r}: every axis size must be a positive integer")
        if not isinstance(self.ep, int) or self.ep < 1 or (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep!r}: expert parallelism folds onto the data- and "
                              f"context-parallel ranks, so ep must divide dp x cp = {self.dp * self.cp}")
        replicas = self.dp * self.cp
        if not isinstance(self.shard_group, int) or self.shard_group < 0 or (
                self.shard_group and replicas % self.shard_group):
            fits = [d for d in range(2, replicas) if replicas % d == 0]
            raise LayoutError(f"shard_group={self.shard_group!r}: HSDP shards within groups of "
                              f"dp x cp = {replicas} ranks, so it must divide {replicas}"
                              + (f" (one of {fits})" if fits else " (no smaller group exists)"))
        named = _as_axes(self.order)
        if sorted(a for a in named if a in AXES) != sorted(AXES) or len(set(named)) != len(named):
            raise LayoutError(
                f"order={self.order!r} must name each of {', '.join(AXES)} exactly once "
                f"(domh, domw optional), e.g. {DEFAULT_ORDER!r}"
            )

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp * self.dom

    @property
    def dom(self) -> int:
        """Domain-parallel ranks per sample: domh x domw."""
        return self.domh * self.domw

    @property
    def axis_order(self) -> tuple[str, ...]:
        named = _as_axes(self.order)
        return tuple(a for a in DOMAIN_AXES[::-1] if a not in named) + named

    def size(self, axes: str | Iterable[str]) -> int:
        """Product of the sizes of ``axes`` (``"dp"`` or a combination such as ``"dp-cp"``)."""
        return math.prod(getattr(self, a) for a in _as_axes(axes))

    def _strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for axis in self.axis_order:
            strides[axis] = step
            step *= getattr(self, axis)
        return strides

    # ---- rank math -----------------------------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` along every axis (the domain axes only when the layout
        shards a domain, so layouts without one read as they always have)."""
        self._check_rank(rank)
        strides = self._strides()
        axes = ALL_AXES if self.dom > 1 else AXES
        return {a: (rank // strides[a]) % getattr(self, a) for a in axes}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing axes count as 0)."""
        strides = self._strides()
        rank = 0
        for axis, value in coords.items():
            if axis not in ALL_AXES or not 0 <= value < getattr(self, axis):
                raise LayoutError(f"coordinate {axis}={value} is outside {self.describe()}")
            rank += value * strides[axis]
        return rank

    def ranks_along(self, axes: str | Iterable[str], rank: int) -> list[int]:
        """The ranks that share every coordinate with ``rank`` except those on ``axes``.

        The list is ordered by position in the group: for several axes, the first named
        varies fastest (``"dp-cp"`` numbers cp-peers of one dp replica consecutively
        only if cp is named first; the group's *set* is the same either way).
        """
        names = _as_axes(axes)
        strides, base = self._strides(), self.coords(rank)
        ranks = [rank - sum(base.get(a, 0) * strides[a] for a in names)]  # coordinate 0 on axes
        for axis in names:  # arithmetic, not rank_of per member: groups span thousands
            ranks = [r + i * strides[axis] for i in range(getattr(self, axis)) for r in ranks]
        return sorted(ranks)

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """Every group along ``axes``, ordered by their smallest rank; together they
        partition the world."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            group = self.ranks_along(axes, rank)
            seen.setdefault(group[0], group)
        return [seen[k] for k in sorted(seen)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ({self.describe()})")

    # ---- validation ----------------------------------------------------------------------
    def expert_ranks(self, rank: int) -> list[int]:
        """The ranks whose experts together make each MoE layer's (``ep`` consecutive ranks
        of ``rank``'s dp x cp group): ``rank``'s expert-parallel group."""
        group = self.ranks_along(DP_CP, rank)
        at = group.index(rank) // self.ep * self.ep
        return group[at:at + self.ep]

    def expert_data_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same experts as ``rank`` (places in the dp x cp group
        equal modulo ``ep``): the group its expert gradients are averaged over."""
        group = self.ranks_along(DP_CP, rank)
        return group[group.index(rank) % self.ep::self.ep]

    def shard_ranks(self, rank: int) -> list[int]:
        """HSDP: the ``shard_group`` consecutive ranks of ``rank``'s dp x cp group that
        shard ZeRO-3's states between them."""
        group = self.ranks_along(DP_CP, rank)
        at = group.index(rank) // self.shard_group * self.shard_group
        return group[at:at + self.shard_group]

    def replica_ranks(self, rank: int) -> list[int]:
        """HSDP: the ranks holding the same shard as ``rank``, one per shard group: the
        group its gradient shards are all-reduced over."""
        group = self.ranks_along(DP_CP, rank)
        return group[group.index(rank) % self.shard_group::self.shard_group]

    @property
    def hsdp(self) -> bool:
        """Hybrid sharding: shard groups smaller than dp x cp."""
        return 0 < self.shard_group < self.dp * self.cp

    def check_world(self, world_size: int) -> None:
        """Raise unless the product of the axis sizes is ``world_size``."""
        if world_size != self.world_size:
            raise LayoutError(
                f"{self.describe()} needs {self.world_size} processes but the world has "
                f"{world_size}; change --nproc to {self.world_size} or make "
                f"dp*pp*cp*tp*domain equal {world_size}"
            )

    def describe(self) -> str:
        """Short human form such as ``dp2xtp2 (world 4)``."""
        parts = [f"{a}{getattr(self, a)}" for a in AXES if getattr(self, a) > 1]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.hsdp:
            parts.append(f"hsdp{self.shard_group}")
        if self.dom > 1:
            parts.append(f"dom{self.domh}x{self.domw}" if self.domw > 1 else f"dom{self.domh}")
        parts = parts or ["single"]
        return f"{'x'.join(parts)} (world {self.world_size})"
