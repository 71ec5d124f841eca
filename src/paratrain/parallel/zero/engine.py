"""ZeRO-1, -2 and -3 over the data-parallel group, on flat units (see flat.py).

Per rank, with N data-parallel ranks and Ψ parameters (fp32 training: 4 + 4 + 8 bytes per
parameter; mixed precision: 2 + 2 + 12):

    stage 1: parameters full, gradients full,  optimizer state 1/N    (4Ψ + 4Ψ + 8Ψ/N)
    stage 2: parameters full, gradients 1/N,   optimizer state 1/N    (4Ψ + 4Ψ/N + 8Ψ/N)
    stage 3: parameters 1/N,  gradients 1/N,   optimizer state 1/N    (16Ψ/N)

What moves, per step:
- stage 1 reduce-scatters each unit's accumulated gradient once, after the last
  microbatch's backward (``no_sync`` defers it, like DDP), and all-gathers updated params.
- stages 2 and 3 reduce-scatter each unit's gradient as soon as backward has produced it,
  overlapping the rest of backward, *every microbatch* (they cannot keep a full gradient
  to accumulate into; ``no_sync`` has no effect), and add it to the rank's shard.
- stage 3 all-gathers a unit's parameters just before its forward and again before its
  backward, frees them after, and prefetches the next unit's while the current one computes.
  With ``reshard_after_forward=False`` it keeps them from the first forward of a step to the
  unit's last backward instead: one gather per step, at the price of holding them gathered.

Under pipeline parallelism (stages 2 and 3) ``no_sync`` accumulates the unit's *full*
gradient locally, and the chunk's final backward reduce-scatters it once, overlapping the
rest of backward, exactly as DDP's no_sync does. A pipeline runs many microbatches per step
(m >= pp) on a stage that holds only 1/pp of the model, so holding the stage's full gradient
through the step costs little and saves m - 1 reduce-scatters per unit; without a pipeline
the same choice would hold the whole model's gradient, which is what ZeRO-2 exists to avoid,
so there ``no_sync`` keeps reducing every microbatch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ...accounting import storage_bytes
from ...comm import collectives as C
from ...comm.backend import gather_shards
from ...comm.compress import CompressSpec, all_reduce_bytes, check
from ...optim import adam_step_count, clip_by_squared_norm_
from ..engine import MOMENTS, drop_copy, merge_stages, source_name
from ..hooks import weakly
from ..step import ScheduledStep, StepPlan
from ..tensor import TensorParallel
from .optim import ShardedAdamW
from .units import Unit, allocate, build_units, make_reducer


class ZeroDataParallel(ScheduledStep, nn.Module):
    """Shards optimizer state (stage 1), gradients (2) and parameters (3) over ``group``."""

    def __init__(self, module: nn.Module, group: ProcessGroup, stage: int, optim_cfg,
                 param_dtype: torch.dtype | None = None, offload: bool = False,
                 track_peak: bool = False, tp: TensorParallel | None = None,
                 pp_group: ProcessGroup | None = None, reshard_after_forward: bool = True,
                 compress: "str | CompressSpec" = "none", plan: StepPlan | None = None,
                 ring_collectives: bool | None = None, tied=None, expert=None,
                 shard_group: ProcessGroup | None = None, replica_group: ProcessGroup | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage}")
        self.module, self.group, self.stage, self.tp = module, group, stage, tp
        self.plan = plan or StepPlan.single(module)
        self.pp_group = pp_group  # pipeline stages own disjoint parameters
        self.tied = tied  # this rank's end of a tied embedding under a pipeline (stage 1)
        self.reshard_after_forward = reshard_after_forward
        self.accumulate_full = pp_group is not None  # see the module docstring
        self.expert = expert
        """Expert parallelism (parallel/expert.py): its experts are units of their own,
        sharded over its expert-data-parallel group; None without."""
        self.shard_group, self.replica_group = shard_group or group, replica_group
        """HSDP: the ranks the (dense) units are sharded over, and those holding the same
        shard, whose gradients are averaged once per step (None: no replicas)."""
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        """Parameters no gradient moves (an MoE router's selection bias): whole on every
        rank, in no unit."""
        allocate(self.frozen, self.plan.device)
        with torch.no_grad():  # replicas must start identical (a meta model is filled later)
            for tensor in [*module.parameters(), *module.buffers()]:
                if not tensor.is_meta:
                    held_by = self._experts_group if self._is_expert(tensor) else group
                    C.broadcast(tensor, src=0, group=held_by)
        self.units = build_units(module, self.shard_group, stage, param_dtype, self.plan.device, expert)
        if tp is not None:  # replicated TP gradients are summed as backward makes them
            tp.register_grad_sync_hooks()  # (after build_unit: adopting a meta parameter drops hooks)
        self.optimizer = ShardedAdamW(self.units, optim_cfg, offload=offload)
        # Stage 1 keeps each unit's full gradient, so it can be averaged by a compressor
        # (comm/compress.py) instead of a reduce-scatter; stages 2/3 are refused by check().
        # ring_collectives: the backend's flat collectives, or forced (comm/backend.py).
        self.ring = ring_collectives
        self.reducer = make_reducer([u for u in self.units if not u.expert], self.shard_group,
                                check(compress, stage), ring_collectives)
        self.expert_reducer = (make_reducer([u for u in self.units if u.expert], self._experts_group,
                                        check("none", stage), ring_collectives)
                               if expert is not None else None)
        """The expert units' averages over the expert-data-parallel group."""
        self._sync = True
        self._in_flight: list[Unit] = []
        # Units in the order the first forward ran them (registration order need not be
        # it: a U-Net registers its encoder and decoder lists apart, and runs them
        # interleaved): prefetch follows it once it is complete.
        self._order: list[int] = []
        self._position: dict[int, int] = {}  # unit index -> its place in _order
        self.track_peak = track_peak  # measuring live bytes at every hook costs time
        self.peak_bytes = 0
        self._register_hooks()

    def _register_hooks(self) -> None:
        for index, unit in enumerate(self.units):
            for p in unit.flat.params:
                p.register_post_accumulate_grad_hook(weakly(
                    self, lambda zero, p, i=index: zero._on_grad_ready(zero.units[i], p)))
            if self.stage == 3:
                # First of the unit's pre-hooks: others (a TP region's entry computes the
                # column GEMMs) need the gathered weights.
                for module in unit.modules:  # a tied embedding's unit runs at both ends
                    module.register_forward_pre_hook(lambda m, a, i=index: self._pre_forward(i),
                                                     prepend=True)
                    module.register_forward_hook(lambda m, a, out, i=index: self._post_forward(i, out))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def _experts_group(self) -> ProcessGroup | None:
        return self.expert.data_group if self.expert is not None else None

    def _is_expert(self, param: torch.Tensor) -> bool:
        return self.expert is not None and self.expert.is_expert(param)

    def _group_of(self, unit: Unit) -> ProcessGroup:
        """The ranks a unit is sharded over."""
        return self._experts_group if unit.expert else self.shard_group

    # ---- stage 3: gather, free, prefetch ---------------------------------------------------
    def _gather(self, index: int, wait: bool) -> None:
        if not 0 <= index < len(self.units):
            return
        unit = self.units[index]
        if unit.gather_work is None and not unit.flat.gathered:
            unit.flat.allocate()
            unit.gather_work = C.all_gather(unit.flat.flat, unit.shard, self._group_of(unit), async_op=True)
            self._record_peak()
        if wait and unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None

    def _release(self, unit: Unit) -> None:
        """Free a unit's gathered parameters, after any prefetch still filling them: a
        prefetched unit that runs later than guessed must not keep a gather into freed
        memory (it would be waited on, and read, after the free)."""
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None
        unit.flat.free()

    def _neighbour(self, index: int, step: int) -> int:
        """The unit that runs ``step`` (+1: next in forward, -1: next in backward) after
        ``index``: by the first forward's order once it is complete, before that by
        registration order."""
        if len(self._order) < len(self.units):
            return index + step
        at = self._position[index] + step
        return self._order[at] if 0 <= at < len(self._order) else -1

    def _pre_forward(self, index: int) -> None:
        if len(self._order) < len(self.units) and index not in self._position:
            self._position[index] = len(self._order)
            self._order.append(index)
        self._gather(index, wait=True)
        self._gather(self._neighbour(index, +1), wait=False)  # prefetch: overlaps this compute

    def _post_forward(self, index: int, output) -> None:
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, i=index: self._pre_backward(i))
        last = self._neighbour(index, +1) in (-1, len(self.units))  # its backward comes next
        keep = torch.is_grad_enabled() and (last or not self.reshard_after_forward)
        if not keep:
            self._release(self.units[index])

    def _pre_backward(self, index: int) -> None:
        self._gather(index, wait=True)
        self._gather(self._neighbour(index, -1), wait=False)  # the unit backward reaches next

    # ---- gradients -------------------------------------------------------------------------
    def _on_grad_ready(self, unit: Unit, param: nn.Parameter) -> None:
        if self.track_peak:
            self._record_peak(extra=param.grad.numel() * param.grad.element_size())
        if self.stage >= 2:
            unit.stash_grad(param)  # into the unit's temporary flat gradient; frees param.grad
        elif not self._sync:
            return
        if self.tied is not None and param is self.tied.param:
            return  # reduced once the two ends' gradients are added (finish_grad_sync)
        unit.ready.add(param)
        if len(unit.ready) < len(unit.flat.params):
            return
        if self._sync or not self.accumulate_full:
            self._start_reduce(unit)
            return
        unit.ready.clear()  # this microbatch's gradient is in; the step's last one reduces
        if self.stage == 3 and self.reshard_after_forward:
            self._release(unit)

    def _start_reduce(self, unit: Unit) -> None:
        """Reduce-scatter (average) a unit's gradient; stage 3 also frees its parameters."""
        # One reduction in flight at a time: it overlaps the next unit's backward, and at
        # most two units' full gradients (that one and the one being produced) exist at once.
        if self.stage >= 2 and self._in_flight:
            self._in_flight.pop(0).finish_reduce()
        if unit.expert:  # ep ranks' tokens, averaged over dp x cp / ep replicas (expert.py)
            unit.start_reduce(self.expert_reducer, 1 / self.expert.size)
        else:
            unit.start_reduce(self.reducer)
        self._in_flight.append(unit)
        if self.stage == 3 and (self._sync or self.reshard_after_forward):
            self._release(unit)  # kept otherwise: the next microbatch of the step needs it

    def start_grad_sync(self) -> None:
        """Launch the reduction of every unit not launched in this backward pass (e.g. one
        whose parameters got no gradient)."""
        for unit in self.units:
            if not unit.launched:
                self._start_reduce(unit)

    def finish_grad_sync(self) -> None:
        """Wait for every gradient reduction; after it each rank holds its averaged shard."""
        if self.tied is not None:
            self.tied.sync_grad()
        self.start_grad_sync()
        self._drain()
        if self.replica_group is not None:
            self._average_replicas()
        if self.stage == 3:
            for unit in self.units:
                self._release(unit)
        self._record_peak()

    def _average_replicas(self) -> None:
        """HSDP: average each dense unit's gradient shard over the ranks holding the same
        shard, once per step (the shard group already averaged its members')."""
        units = [u for u in self.units if not u.expert]
        C.wait_all([C.all_reduce(u.grad_shard, self.replica_group, async_op=True) for u in units])
        replicas = C.size(self.replica_group)
        for unit in units:
            unit.grad_shard.mul_(1 / replicas)
            self.reducer[unit.index].sent_bytes += all_reduce_bytes(
                unit.grad_shard.numel() * unit.grad_shard.element_size(), replicas)

    def _drain(self) -> None:
        """Wait for the reductions in flight; the next backward starts a new round."""
        while self._in_flight:
            self._in_flight.pop(0).finish_reduce()
        for unit in self.units:
            unit.launched = False
            unit.ready.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full gradients locally (stage 1; stages 2/3 under a pipeline); without
        a pipeline stages 2/3 reduce every microbatch (module docstring)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous
            if self.stage >= 2 and not self.accumulate_full:
                self.start_grad_sync()
                self._drain()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for unit in self.units:
            unit.zero_grads()

    # ---- optimizer -------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm from the shards, each element counted once; clip in place.
        Experts' shards partition them over dp x cp (edp x ep), as dense shards do without
        HSDP; with it, dense shards repeat over the replicas, so only the shard group sums
        them."""
        not_owned = {self.tied.param} if self.tied is not None and self.tied.is_copy else set()
        if self.tp is not None:  # one tp rank counts each replicated parameter
            owned = set(self.tp.owned_params())
            not_owned |= {p for p in self.module.parameters() if p not in owned}
        dense = self.optimizer.squared_norm([u for u in self.units if not u.expert], not_owned)
        experts = self.optimizer.squared_norm([u for u in self.units if u.expert], not_owned)
        if self.replica_group is not None:
            C.all_reduce(dense, self.shard_group)
            C.all_reduce(experts, self.group)
            sq, groups = dense + experts, ()
        else:
            sq, groups = dense + experts, (self.group,)
        groups += (self.pp_group,) if self.pp_group is not None else ()
        groups += (self.tp.group,) if self.tp is not None else ()
        return clip_by_squared_norm_(sq, max_norm, groups, [u.grad_shard for u in self.units])

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Update this rank's shards; stages 1/2 then all-gather the full parameters."""
        self.optimizer.step(lr)
        if self.stage == 3:
            return
        for expert in (False, True) if self.expert is not None else (False,):
            units = [u for u in self.units if u.expert == expert]
            gather_shards([(u.flat.flat, u.flat.own_slice(u.flat.flat)) for u in units],
                          self._experts_group if expert else self.group, self.ring)

    # ---- inspection ------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors that hold this rank's parameters, gradients and optimizer state."""
        params = [u.flat.flat for u in self.units if not u.flat.flat.is_meta]
        params += [u.shard for u in self.units if u.shard is not None]
        grads = [g for u in self.units for g in u.grad_tensors()]
        return {"params": params, "grads": grads, "optim": self.optimizer.state_tensors()}

    def live_bytes(self) -> int:
        """Bytes of parameter, gradient and optimizer tensors alive right now on this rank."""
        return sum(storage_bytes(kind) for kind in self.state_tensors().values())

    def _record_peak(self, extra: int = 0) -> None:
        if self.track_peak:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes() + extra)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under their model names (collective: every rank calls it)."""
        out = {}
        for unit in self.units:
            full = unit.flat.flat
            if self.stage == 3:  # gathered into a buffer of its own: the unit's may be freed
                full = torch.empty(unit.flat.padded, dtype=full.dtype, device=unit.flat.device)
                C.all_gather(full, unit.shard, self._group_of(unit))
            for name, view in zip(unit.flat.names, unit.flat.copy_out(full)):
                out[name] = self.expert.gather(view) if unit.expert else view.detach().clone()
        names = {p: n for n, p in self.module.named_parameters()}
        out.update({names[p]: p.detach().clone() for p in self.frozen})
        if self.tp is not None:
            out = self.tp.full_state_dict(self.module, local=out)
        return drop_copy(merge_stages(out, self.pp_group), self.plan)


    # ---- checkpoints: Adam's moments in the plain model's terms -------------------------------
    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.reducer.local_state()

    def load_rank_state(self, saved: dict[str, torch.Tensor]) -> str | None:
        return self.reducer.load_state(saved, dist.group.WORLD)

    @torch.no_grad()
    def load_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Install this rank's slices of full moments (from any layout) after ``step`` steps."""
        self.load_rank_state(moments.get("compress", {}))
        state = self.optimizer.optimizer.state
        for unit, views in zip(self.units, self.optimizer.unit_views):
            slices = {}
            for key in MOMENTS:
                flat = torch.zeros(unit.flat.padded)
                for name, p, offset in zip(unit.flat.names, unit.flat.params, unit.flat.offsets):
                    full = moments[key][source_name(name, self.plan)]
                    if unit.expert:
                        local = self.expert.local_shard(p, full)
                    else:
                        local = self.tp.local_shard(p, full) if self.tp is not None else full
                    flat[offset:offset + p.numel()] = local.reshape(-1)
                slices[key] = unit.flat.own_slice(flat).split([v.numel() for v in views])
            for i, view in enumerate(views):
                state[view] = {"step": adam_step_count(self.optimizer.optimizer, step, view.device),
                               **{k: slices[k][i].to(view.device).clone() for k in MOMENTS}}


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []

