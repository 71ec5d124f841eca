"""The interface the training loop drives (``Engine``), and the data-parallel
(replicated) engine.

An engine owns the parallel wrapper *and* the optimizer, because sharded strategies
(ZeRO) shard the optimizer too; it also owns the step's forward and backward
(``forward_backward``, parallel/step.py), so the loop reads the same whatever the layout.
"""

from __future__ import annotations

import re
from typing import ContextManager, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..optim import MOMENTS, adam_step_count, build_adamw, clip_grad_norm_, set_lr
from ..comm.reducer import GradReducer
from .data import DataParallel
from .masters import MasterWeights
from .step import Batch, ScheduledStep, StepLoss, StepPlan
from .tensor import TensorParallel

__all__ = ["MOMENTS", "Engine", "ReplicatedEngine", "merge_stages", "plain_name"]


class Engine(Protocol):
    """What the training loop needs of a parallel model and its optimizer: the step
    (forward-backward, clip, step) and the state (tensors, checkpoints). How gradients are
    averaged, and what that keeps, is the ``reducer``'s."""

    module: nn.Module
    """The (parallelized) model: under pipeline parallelism, the list of this rank's chunks."""
    plan: StepPlan
    """What every step shares (parallel/step.py)."""
    reducer: GradReducer
    """The data-parallel reduction: bytes sent, the undo of a skipped step, its own state."""

    def forward_backward(self, batches: Sequence[Batch], loss_scale: float,
                         training: bool = True) -> StepLoss:
        """Forward and backward of a step's microbatches (forward only when not training);
        gradients reduced on return."""

    def no_sync(self) -> ContextManager[None]:
        """Accumulate gradients without communicating (every backward but a step's last)."""

    def finish_grad_sync(self) -> None:
        """Wait for the gradient reduction started by the last backward."""

    def zero_grad(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (on the device); clips in place (0: only measures)."""

    def step(self, lr: float) -> None:
        """Optimizer step at ``lr`` (and whatever it implies, e.g. ZeRO's all-gather)."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """{"params", "grads", "optim"}: this rank's tensors, for exact accounting."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the plain model's names (collective)."""

    def load_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Install this rank's share of full moments after ``step`` steps."""

    def rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state besides parameters and moments (the reducer's), which
        checkpoints keep per rank."""

    def load_rank_state(self, saved: dict[str, torch.Tensor]) -> str | None:
        """Install ``rank_state`` from a checkpoint on every rank or on none (collective);
        the reason it was not, or None."""


class ReplicatedEngine(ScheduledStep, nn.Module):
    """DDP: every rank holds the model and a full AdamW; gradients are averaged."""

    def __init__(self, dp: DataParallel, optim_cfg, tp: TensorParallel | None = None,
                 pp_group: ProcessGroup | None = None, plan: StepPlan | None = None):
        super().__init__()
        self.dp, self.tp, self.pp_group = dp, tp, pp_group
        self.ep = dp.expert
        """Expert parallelism (parallel/expert.py), or None."""
        self.tied = dp.tied
        """This rank's end of a tied embedding under a pipeline, or None."""
        self.module = dp.module
        self.plan = plan or StepPlan.single(dp.module)
        trained = [p for p in dp.module.parameters() if p.requires_grad]
        self.masters = (MasterWeights(trained) if any(p.dtype != torch.float32 for p in trained)
                        else None)
        """fp32 masters of bf16 parameters (parallel/masters.py), or None: fp32 parameters
        are stepped themselves."""
        self.optimizer = build_adamw(self.masters.tensors() if self.masters else trained, optim_cfg)
        self.reducer = dp.reducer
        self.expert_reducer = dp.expert_reducer
        """The experts' gradients over their own group (parallel/expert.py), or None."""

    def forward(self, *args, **kwargs):
        return self.dp(*args, **kwargs)

    def no_sync(self):
        return self.dp.no_sync()

    def finish_grad_sync(self) -> None:
        self.dp.finish_grad_sync()
        if self.tp is not None:  # norm weights under SP saw only their sequence shard
            self.tp.sync_replicated_grads()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.dp.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self._norm(max_norm)

    def _norm(self, max_norm: float) -> torch.Tensor:
        # Replicated over data-parallel ranks, so no dp reduction; every other parameter is
        # counted on exactly one rank of the ranks holding it, and the sums added over them:
        # over tp each rank counts its shards and one rank each replicated parameter; over
        # ep each rank its experts and the first the rest; pipeline stages own disjoint
        # parameters; the last stage's copy of a tied embedding is the first's to count.
        params = list(self.module.parameters())
        owned = set(self.tp.owned_params()) if self.tp is not None else set(params)
        groups = (self.tp.group,) if self.tp is not None else ()
        if self.ep is not None:
            first = C.rank(self.ep.group) == 0
            owned = {p for p in owned if first or self.ep.is_expert(p)}
            groups += (self.ep.group,)
        if self.tied is not None and self.tied.is_copy:
            owned.discard(self.tied.param)
        groups += (self.pp_group,) if self.pp_group is not None else ()
        grads = [p.grad for p in params]
        return clip_grad_norm_([p.grad for p in params if p in owned], max_norm, groups=groups, scale=grads)

    def step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        if self.masters is not None:
            self.masters.bind_grads()
        self.optimizer.step()
        if self.masters is not None:  # the next forward computes with the rounded masters
            self.masters.write_back()

    def optimized(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps (and keeps state for) for ``param``: its fp32
        master under bf16 parameters, else the parameter itself."""
        return self.masters.of(param) if self.masters is not None else param

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.module.parameters())
        optim = [v for state in self.optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]  # skip Adam's 0-d step counters
        optim += self.masters.tensors() if self.masters is not None else []
        return {"params": params, "grads": [p.grad for p in params], "optim": optim}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.tp is not None:
            local = self.tp.full_state_dict(self.module)
        else:
            local = {k: v.detach().clone() for k, v in self.module.named_parameters()}
        if self.ep is not None:  # every ep rank's experts (whole on each tp rank)
            experts = {k for k, v in self.module.named_parameters() if self.ep.is_expert(v)}
            local = {k: self.ep.gather(v) if k in experts else v for k, v in local.items()}
        return drop_copy(merge_stages(local, self.pp_group), self.plan)

    def load_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Install this rank's share of full moments (from any layout) after ``step`` steps."""
        self.load_rank_state(moments.get("compress", {}))
        for name, p in self.module.named_parameters():
            state = {"step": adam_step_count(self.optimizer, step, p.device)}
            for key in MOMENTS:
                full = moments[key][source_name(name, self.plan)].to(p.device)
                if self.ep is not None and self.ep.is_expert(p):
                    state[key] = self.ep.local_shard(p, full)
                else:
                    state[key] = self.tp.local_shard(p, full) if self.tp is not None else full.clone()
            self.optimizer.state[self.optimized(p)] = state


    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.reducer.local_state()

    def load_rank_state(self, saved: dict[str, torch.Tensor]) -> str | None:
        return self.reducer.load_state(saved, dist.group.WORLD)


def source_name(name: str, plan: StepPlan) -> str:
    """The plain model's tensor a parameter is loaded from: its own, or for the last
    stage's copy of a tied embedding (parallel/pipeline/tied.py), the embedding's."""
    plain = plain_name(name)
    return plan.tied_copy[1] if plan.tied_copy and plain == plan.tied_copy[0] else plain


def drop_copy(params: dict[str, torch.Tensor], plan: StepPlan) -> dict[str, torch.Tensor]:
    """The plain model's tensors: without the last stage's copy of a tied embedding."""
    return {k: v for k, v in params.items() if not plan.tied_copy or k != plan.tied_copy[0]}


def plain_name(name: str) -> str:
    """A parameter's name in the plain model: a pipeline rank's chunks are a module list,
    so their names start with the chunk's index ('0.layers.3...'), which is dropped."""
    return re.sub(r"^\d+\.", "", name)


def merge_stages(local: dict[str, torch.Tensor], pp_group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Every pipeline stage's parameters under the plain model's names (collective over
    ``pp_group``). A rank's chunks are a module list, so their names start with the chunk's
    index ('0.layers.3...'), which is dropped."""
    if pp_group is None:
        return local
    mine = {plain_name(k): v.cpu() for k, v in local.items()}
    stages: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()}
