"""Data parallelism: replicate the model, shard the batch, average gradients in buckets
while backward is still running.

Gradients live in a few flat buffers ("buckets"), and each parameter's ``.grad`` is a view
into one of them, so reducing a bucket is one collective on contiguous memory with no
copies. Buckets are filled in reverse parameter order, roughly the order backward
produces gradients. When the last gradient of a bucket has been accumulated, that
bucket's all-reduce is launched asynchronously (``start_grad_sync``) and backward carries
on computing the earlier layers; ``finish_grad_sync`` waits for all of them before the
optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..comm import collectives as C
from ..comm.compress import CompressSpec, parse
from ..comm.reducer import GradReducer
from .hooks import weakly


@dataclass
class Bucket:
    """A flat gradient buffer shared by a few parameters."""

    params: list[nn.Parameter]
    """Parameters whose gradients are views into ``buffer``."""
    buffer: torch.Tensor
    """The flat gradients, reduced as one tensor."""
    offsets: dict[torch.Tensor, int]
    """Start of each parameter's gradient in ``buffer``, by ``param``."""
    ready: set[torch.Tensor] = field(default_factory=set)
    """The parameters whose gradient this backward pass has produced."""
    index: int = 0
    """Its place among the buckets (the reducer keeps each bucket's state by it)."""
    work: object | None = None
    """The in-flight average (a ``Pending``), if launched."""
    expert: bool = False
    """Holds expert gradients: averaged over the expert-data-parallel group, after a
    scale of 1 / ep (parallel/expert.py)."""


def make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Group ``params`` (in the given order) into buckets of about ``bucket_bytes`` each,
    one dtype per bucket, and make every parameter's ``.grad`` a view into its bucket."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size >= bucket_bytes or groups[-1][0].dtype != p.dtype:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    buckets = []
    for group in groups:
        buffer = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype,
                             device=group[0].device)
        offsets, offset = {}, 0
        for p in group:
            p.grad = buffer[offset:offset + p.numel()].view_as(p)
            offsets[p] = offset
            offset += p.numel()
        buckets.append(Bucket(group, buffer, offsets, index=len(buckets)))
    return buckets


class DataParallel(nn.Module):
    """Wraps a model whose replicas on ``group`` each see a different slice of the batch.

    After ``backward`` and ``finish_grad_sync()`` every replica holds the average of the
    replicas' gradients. Under ``no_sync()`` gradients only accumulate locally (gradient
    accumulation); the first backward outside it reduces the accumulated sum.
    """

    def __init__(self, module: nn.Module, group: ProcessGroup, bucket_mb: float = 4.0,
                 broadcast_from_first: bool = True, compress: "str | CompressSpec" = "none",
                 defer: bool = False, expert=None, tied=None):
        super().__init__()
        self.module = module
        self.group = group
        self.expert = expert
        """Expert parallelism (parallel/expert.py), whose expert parameters are reduced
        over its expert-data-parallel group; None without."""
        self.tied = tied
        """This rank's end of a tied embedding under a pipeline (parallel/pipeline/tied.py):
        its gradient waits for the other end's before its bucket is reduced."""
        params = [p for p in module.parameters() if p.requires_grad]
        experts = [p for p in params if expert is not None and expert.is_expert(p)]
        dense = [p for p in params if expert is None or not expert.is_expert(p)]
        if broadcast_from_first:  # replicas must start identical, whatever their seeds
            with torch.no_grad():
                for tensor in [*dense, *module.buffers()]:
                    C.broadcast(tensor, src=0, group=group)
                for tensor in experts:
                    C.broadcast(tensor, src=0, group=expert.data_group)
        size = max(1, int(bucket_mb * 2**20))
        self.buckets = make_buckets(dense[::-1], size)
        self.expert_buckets = make_buckets(experts[::-1], size)
        for b in self.expert_buckets:
            b.expert = True
        self._bucket_of = {p: b for b in self.all_buckets for p in b.params}
        self.name_of = {p: n for n, p in module.named_parameters()}
        """Each parameter's name in the module (reduction state is keyed by names)."""
        self.reducer = self._reducer(self.buckets, group, compress)
        """How each bucket is averaged, and what that keeps between steps (comm/reducer.py)."""
        self.expert_reducer = (self._reducer(self.expert_buckets, expert.data_group, "none")
                               if experts else None)
        """The expert buckets' average over the expert-data-parallel group."""
        self.deferred = defer
        """Backward reduces nothing: the engine reduces after its step (``:update``,
        parallel/local_update.py)."""
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(weakly(self, DataParallel._on_grad_ready))
                       for p in params]

    def _reducer(self, buckets: list[Bucket], group: ProcessGroup, compress) -> GradReducer:
        return GradReducer(parse(compress), [
            ([(b.offsets[p], p.shape) for p in b.params], b.buffer.numel()) for b in buckets],
            group, device=buckets[0].buffer.device if buckets else None,
            names=[[self.name_of[p] for p in b.params] for b in buckets])

    @property
    def all_buckets(self) -> list[Bucket]:
        return self.buckets + self.expert_buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; nothing is communicated inside this block."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        self._keep_in_bucket(param, bucket)
        if not self._sync or self.deferred:
            return
        if bucket.work is not None:
            raise RuntimeError("a backward pass produced gradients for a bucket that is already "
                               "being reduced: call finish_grad_sync() after each synced "
                               "backward, and run accumulation backwards inside no_sync()")
        if self.tied is not None and param is self.tied.param:
            return  # reduced after the two ends' gradients are added (finish_grad_sync)
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            self.start_grad_sync(bucket)

    def _keep_in_bucket(self, param: nn.Parameter, bucket: Bucket) -> None:
        """If something replaced ``param.grad`` (e.g. ``zero_grad(set_to_none=True)``),
        move the gradient back into the bucket so it is reduced."""
        offset = bucket.offsets[param]
        view = bucket.buffer[offset:offset + param.numel()].view_as(param)
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def start_grad_sync(self, bucket: Bucket) -> None:
        """Launch the asynchronous average of one bucket over the data-parallel group."""
        if bucket.work is None and bucket.expert:
            bucket.buffer.mul_(1 / self.expert.size)
            bucket.work = self.expert_reducer.average(bucket.index, bucket.buffer)
        elif bucket.work is None:
            bucket.work = self.reducer.average(bucket.index, bucket.buffer)

    def finish_grad_sync(self) -> None:
        """Launch any bucket not yet launched (e.g. holding unused parameters), then wait
        for all. Call after the last backward of a step, before the optimizer step."""
        if self.deferred:
            return
        if self.tied is not None:
            self.tied.sync_grad()
        for bucket in self.all_buckets:
            self.start_grad_sync(bucket)
        for bucket in self.all_buckets:  # second collectives (int8, PowerSGD) start as firsts end
            bucket.work.advance()
        for bucket in self.all_buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buckets in place (gradients stay views into them)."""
        for bucket in self.all_buckets:
            bucket.buffer.zero_()
