"""``--compress METHOD:update``: data parallelism that averages each rank's AdamW update
instead of its gradient (Deep Gradient Compression's momentum correction, Lin et al. 2018,
carried over from SGD's momentum to AdamW).

Why. With top-k at 1%, error feedback sends a coordinate's accumulated gradient about once
per 100 steps. AdamW divides every coordinate by the root of its second moment, so a value
gathered over 100 steps and sent once moves the weight by a few learning rates, where dense
training would have moved it by about 100: the sum that error feedback keeps is normalised
away (docs/compression.md, "top-k 1% under AdamW"). DGC met the same with SGD's momentum and
moved the momentum before the compression. Here every rank steps AdamW on its own gradient,
and the compressed reduction averages the updates, lr * m_hat / (sqrt(v_hat) + eps): error
feedback keeps their sum, and nothing after the reduction is nonlinear.

The price. Each rank's Adam moments are its own (from its share of the batch), so
checkpoints keep them per rank with the residual (``rank_state``); each rank keeps a
copy of the parameters the update starts from; and the reduction cannot overlap the backward
(there is no update before the step's last backward). Clipping is local, as in DGC: every
rank scales its gradient by one factor, from the root mean square of the ranks' own norms
against sqrt(p) x ``grad_clip`` (a gradient averaged over 1/p of the batch has about sqrt(p)
times the norm of the whole batch's, where noise dominates). Weight decay stays out of the
compressed update: every rank applies the same decay exactly.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..optim import MOMENTS, clip_by_squared_norm_, set_lr
from .data import Bucket, DataParallel
from .engine import ReplicatedEngine
from .step import StepPlan
from .tensor import TensorParallel


class LocalUpdateEngine(ReplicatedEngine):
    """DDP whose reduction averages each rank's AdamW update instead of its gradient
    (``--compress METHOD:update``): the engine of the module docstring. Its ``DataParallel``
    is built with ``defer=True``, so backward reduces nothing; the step does."""

    def __init__(self, dp: DataParallel, optim_cfg, tp: TensorParallel | None = None,
                 pp_group: ProcessGroup | None = None, plan: StepPlan | None = None):
        if not dp.deferred:
            raise ValueError("averaging AdamW's updates needs DataParallel(defer=True): a "
                             "reduction in backward would average the gradients as well")
        super().__init__(dp, optim_cfg, tp, pp_group, plan)
        self.origin = [torch.empty_like(b.buffer) for b in dp.buckets]
        """Per bucket, the parameters before this step's update (flat, as the bucket)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this rank's gradient by the factor every rank shares (DGC's local
        clipping); returns the root mean square of the ranks' norms (0: only measure). The
        norm summed over the p ranks is sqrt(p) x their RMS, so clipping it at p x max_norm
        clips the RMS at sqrt(p) x max_norm."""
        p = C.size(self.dp.group)
        own = self._norm(0.0)
        total = clip_by_squared_norm_(own.float().pow(2), p * max_norm, (self.dp.group,),
                                      [b.buffer for b in self.dp.buckets])
        return total / math.sqrt(p)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on this rank's gradient, then the parameters move by the (compressed)
        average of the ranks' updates from where they started, with weight decay applied
        alike on every rank."""
        buckets = self.dp.buckets
        for bucket, origin in zip(buckets, self.origin):
            for p in bucket.params:
                _view(origin, bucket, p).copy_(p)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        keep = {p: 1 - lr * group["weight_decay"] for group in self.optimizer.param_groups
                for p in group["params"]}
        for bucket, origin in zip(buckets, self.origin):  # the update, into the spent gradient
            for p in bucket.params:
                torch.mul(_view(origin, bucket, p), keep[p], out=_view(bucket.buffer, bucket, p)).sub_(p)
        pending = [self.reducer.average(b.index, b.buffer) for b in buckets]
        for work in pending:  # second collectives start as firsts end (DataParallel)
            work.advance()
        for work in pending:
            work.wait()
        for bucket, origin in zip(buckets, self.origin):
            for p in bucket.params:
                p.copy_(_view(origin, bucket, p)).mul_(keep[p]).sub_(_view(bucket.buffer, bucket, p))

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().state_tensors()
        return {**tensors, "optim": tensors["optim"] + self.origin}

    def _moments(self) -> dict[str, torch.Tensor]:
        """This rank's own Adam moments (from its share of the batch), kept per rank in
        checkpoints beside its residual."""
        return {f"adam/{n}.{k}": v for p, n in self.dp.name_of.items()
                for k, v in self.optimizer.state.get(p, {}).items() if k in MOMENTS}

    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.reducer.local_state(self._moments())

    def load_rank_state(self, saved: dict[str, torch.Tensor]) -> str | None:
        return self.reducer.load_state(saved, dist.group.WORLD, self._moments())


def _view(flat: torch.Tensor, bucket: Bucket, p: nn.Parameter) -> torch.Tensor:
    offset = bucket.offsets[p]
    return flat[offset:offset + p.numel()].view_as(p)
