"""One step path for every engine: forward and backward of a step's microbatches, run by
the pipeline executor whatever the layout.

Without pipeline parallelism a rank is a one-stage pipeline holding one chunk, the whole
model, and its table is 1F1B of one stage (``F0 B0 F1 B1 ...``): exactly gradient
accumulation, with ``no_sync`` on every backward but the last, as DDP does it. With
pipeline parallelism the same executor runs the rank's row of the schedule. Evaluation is
the forward-only table. So the loop never asks which layout it runs.

``StepPlan`` holds what is the same for every step of a run (the chunks, the pipeline
group, the shape of the activations that travel between stages, the tokens' positions,
the precision policy), computed once by ``parallelize``; ``run_step`` is what each
engine's ``forward_backward`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ContextManager, NamedTuple, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from .balance import Balance
from .context import shard_batch
from .pipeline import Recorder, forward_schedule, run_schedule, schedule
from .pipeline.schedules import placement

Batch = tuple[torch.Tensor, torch.Tensor]
"""A microbatch of this data-parallel rank: (tokens, targets), each (micro_batch, seq)."""


class StepLoss(NamedTuple):
    """Summed (unscaled) token losses of a step, kept on the device."""

    total: torch.Tensor
    """Over the whole global batch: the same number on every rank."""
    local: torch.Tensor
    """This rank's own share (non-zero on the last pipeline stage only): names the rank
    whose loss was not finite."""


@dataclass
class StepPlan:
    """What every step of a run shares; built once by ``parallelize``."""

    chunks: list[nn.Module]
    """This rank's model chunks, in local order (no pipeline: one, the whole model)."""
    device: torch.device
    """Where the model computes."""
    act_shape: tuple[int, ...]
    """(micro_batch, seq, d_model) of the stream between pipeline stages, seq as this rank
    holds it (cut by context and sequence parallelism)."""
    act_dtype: torch.dtype
    """Dtype of that stream (the parameters' dtype)."""
    schedule: str = "1f1b"
    """The pipeline schedule ('1f1b' for a one-stage pipeline)."""
    pp_group: ProcessGroup | None = None
    """The pipeline group; None without pipeline parallelism."""
    loss_groups: tuple[ProcessGroup, ...] = ()
    """Groups over which the summed loss is added up: the pipeline (only its last stage
    has it) and the ranks that see different tokens (data x context parallel)."""
    cp_group: ProcessGroup | None = None
    """The context-parallel group: each rank gets its load-balanced share of the sequence."""
    positions: torch.Tensor | None = None
    """The tokens' places in the sequence when the stream does not say (sequence
    parallelism cuts the stream between stages; attention sees all of it)."""
    average_over: int = 1
    """Ranks whose gradients the engine averages (data x context parallel): each rank's
    loss is scaled by it, so the average is the gradient of the global batch's mean loss."""
    autocast_bf16: bool = False
    """Run forwards under bf16 autocast (bf16 training over fp32 weights); sharded engines
    that hold bf16 weights need none."""
    recorder: Recorder | None = None
    """Collects this rank's pipeline timeline, when asked for."""
    balance: Balance | None = None
    """The chunks' mixture-of-experts layers (parallel/balance.py); None for a dense model."""
    tied_copy: tuple[str, str] | None = None
    """Under a pipeline with tied embeddings: the name of the last stage's copy (the head's
    weight), not a tensor of the plain model, and of the tensor it copies (the
    embedding's); None otherwise. Every rank knows it."""
    _tables: dict = field(default_factory=dict)

    @classmethod
    def single(cls, module: nn.Module) -> "StepPlan":
        """One chunk on one rank: the plan of an engine built by hand (tests, the Python API)."""
        p = next(module.parameters())
        return cls([module], p.device, (), p.dtype, balance=Balance.find([module]))

    @property
    def stages(self) -> int:
        return C.size(self.pp_group) if self.pp_group is not None else 1

    def table(self, microbatches: int, training: bool) -> list:
        """This rank's actions for a step of ``microbatches`` (built once per count)."""
        key = (microbatches, training)
        if key not in self._tables:
            pp, v = self.stages, len(self.chunks)
            tables = (schedule(self.schedule, pp, microbatches, v) if training
                      else forward_schedule(pp, microbatches, v, placement(self.schedule)))
            rank = C.rank(self.pp_group) if self.pp_group is not None else 0
            self._tables[key] = tables[rank]
        return self._tables[key]

    def autocast(self) -> ContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)

    def local(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """This rank's share of a microbatch: all of it, or under context parallelism its
        load-balanced slice of each sequence with the slice's positions."""
        tokens, targets = batch
        if self.cp_group is None:
            return tokens, targets, None
        return shard_batch(tokens, targets, C.rank(self.cp_group), C.size(self.cp_group))


def run_step(plan: StepPlan, batches: Sequence[Batch], loss_scale: float, training: bool,
             no_sync: Callable[[], ContextManager]) -> StepLoss:
    """Forward (and backward, when training) of this rank's microbatches; gradients are
    accumulated and their reduction started by the last backward of each chunk. Each
    microbatch's summed loss is multiplied by ``loss_scale`` (1 / tokens in the global
    batch) and by ``plan.average_over`` before backward. Returns the step's summed loss,
    reduced over ``plan.loss_groups`` (collective)."""
    micro = [plan.local(b) for b in batches]
    if plan.balance is not None:  # the aux loss joins the objective scaled like the token loss
        plan.balance.set_loss_scale(loss_scale * plan.average_over)
    local = run_schedule(plan.table(len(micro), training), plan.chunks, micro, plan.pp_group,
                         loss_scale * plan.average_over, plan.device, plan.act_shape, plan.act_dtype,
                         no_sync=no_sync if training else None, positions=plan.positions,
                         recorder=plan.recorder if training else None,
                         autocast=plan.autocast).detach().float()
    total = local.clone()
    for group in plan.loss_groups:
        C.all_reduce(total, group)
    return StepLoss(total, local)



class ScheduledStep:
    """``forward_backward`` for an engine with ``plan``, ``no_sync`` and
    ``finish_grad_sync``: the one step path (mixed into every engine)."""

    plan: StepPlan

    def forward_backward(self, batches: Sequence[Batch], loss_scale: float,
                         training: bool = True) -> StepLoss:
        """Forward and backward of a step's microbatches (``training=False``: forward
        only, no gradients); after it the gradients are reduced. ``loss_scale`` is
        1 / tokens in the global batch: the gradients are then those of its mean loss."""
        loss = run_step(self.plan, batches, loss_scale, training, self.no_sync)
        if training:
            self.finish_grad_sync()
        return loss
