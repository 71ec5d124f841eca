"""Mesh: the process groups of a Layout, built once after ``init_process_group``.

Every parallel module receives the Mesh (or one of its groups) as an argument; there is
no global registry of groups.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .layout import CP, DOMAIN_AXES, DOMH, DOMW, DP, DP_CP, DP_DOM, PP, TP, Layout, _as_axes

# Groups every run needs: one per axis, plus dp x cp, over which gradients are reduced
# (context-parallel ranks hold the same weights but different tokens). Domain parallelism
# adds its rows and columns of ranks, the whole domain, and dp x dom for its gradients; with
# no domain axis these are groups already made (or one-rank groups) and cost nothing new.
MESH_AXES = (TP, CP, PP, DP, DP_CP, DOMH, DOMW, DOMAIN_AXES, DP_DOM)
EP, EDP = "ep", "edp"
SHARD, REPLICA = "shard", "replica"
"""HSDP's groups (``Layout.shard_ranks``, ``Layout.replica_ranks``)."""
EMBEDDING = "embedding"
"""The first and the last rank of a pipeline (only those two have it): a tied embedding's
gradient is summed over them (parallel/pipeline/tied.py)."""
"""Expert parallelism's groups (``Layout.expert_ranks``, ``Layout.expert_data_ranks``)."""


@dataclass
class Mesh:
    """The process groups of one rank under a Layout."""

    layout: Layout
    """The layout these groups realise."""
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where this rank computes: cpu, or its own cuda device."""
    groups: dict[frozenset[str], dist.ProcessGroup] = field(repr=False)
    """One group per axis (and per axis combination in MESH_AXES) containing this rank."""

    @classmethod
    def build(cls, layout: Layout, device: torch.device | None = None,
              timeout_s: float | None = None) -> "Mesh":
        """Create this rank's groups. Collective: every rank of the world must call it.

        Every group gets ``timeout_s`` (default: the world group's, which the launcher set
        from ``--timeout-s``): without it torch would give each group its own 30 minutes."""
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build needs torch.distributed.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        layout.check_world(world)
        if device is None:
            device = _default_device()
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else _world_timeout()
        by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        groups = {}
        for axes in MESH_AXES:
            key = _as_axes(axes)
            ranks = tuple(layout.ranks_along(key, rank))
            if ranks not in by_ranks:
                # Local synchronization: only members take part, so each rank creates just
                # the groups it belongs to (fast start-up at any world size).
                by_ranks[ranks] = dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True,
                                                 group_desc="-".join(key))
            groups[frozenset(key)] = by_ranks[ranks]
        if layout.pp > 1:  # the first and last stage: a tied embedding's two ends
            stages = layout.ranks_along(PP, rank)
            ends = [stages[0], stages[-1]]
            # A middle stage makes a group of its own as well: torch names a group by its
            # ranks and the count of groups its process made before, so every rank must
            # make as many, or later groups get different names on different ranks.
            group = dist.new_group(ends if rank in ends else [rank], timeout=timeout,
                                   use_local_synchronization=True, group_desc=EMBEDDING)
            if rank in ends:
                groups[frozenset((EMBEDDING,))] = group
        if layout.ep > 1:
            # Folded onto dp, yet groups of their own even where the ranks are dp's: the
            # all-to-alls run inside backward while DDP's buckets reduce over dp, in an
            # order that depends on which experts got tokens; on one group the two would
            # interleave differently on different ranks. Named for the watchdog.
            for name, ranks in ((EP, layout.expert_ranks(rank)), (EDP, layout.expert_data_ranks(rank))):
                groups[frozenset((name,))] = dist.new_group(
                    ranks, timeout=timeout, use_local_synchronization=True, group_desc=name)
        if layout.hsdp:  # groups of their own: ZeRO-3's gathers and the replicas' all-reduce
            for name, ranks in ((SHARD, layout.shard_ranks(rank)), (REPLICA, layout.replica_ranks(rank))):
                groups[frozenset((name,))] = dist.new_group(
                    ranks, timeout=timeout, use_local_synchronization=True, group_desc=name)
        return cls(layout=layout, rank=rank, device=device, groups=groups)

    def group(self, axes: str | tuple[str, ...]) -> dist.ProcessGroup:
        """The group along ``axes`` that contains this rank (e.g. ``"tp"``, ``"dp-cp"``;
        ``"ep"`` and ``"edp"``, the expert-parallel and expert-data-parallel groups, when
        the layout folds ep > 1 onto dp)."""
        key = (frozenset((axes,)) if axes in (EP, EDP, EMBEDDING, SHARD, REPLICA)
               else frozenset(_as_axes(axes)))
        if key not in self.groups:
            known = ["-".join(sorted(k)) for k in self.groups]
            raise KeyError(f"the mesh has no group for axes {axes!r}; it has {known}")
        return self.groups[key]

    def ranks(self, axes: str | tuple[str, ...]) -> list[int]:
        """Global ranks of this rank's group along ``axes``, in group-rank order."""
        return self.layout.ranks_along(axes, self.rank)

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        coords = self.layout.coords(self.rank)
        return coords.get(axis, 0) if axis in DOMAIN_AXES else coords[axis]

    def size(self, axes: str | tuple[str, ...]) -> int:
        return self.layout.size(axes)


def _world_timeout() -> datetime.timedelta | None:
    """The timeout the world group was created with (None: torch's default)."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a torch without per-backend options
        return None


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
