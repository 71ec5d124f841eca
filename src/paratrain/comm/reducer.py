"""The data-parallel reduction: the one seam between the strategies that own gradient
buffers and how those buffers are averaged.

DDP (``parallel/data.py``) hands a bucket and gets back a pending average; ZeRO
(``parallel/zero``) hands a unit's flat gradient and the slice it keeps, and gets back a
pending average of that slice. Both come back as a ``Pending`` to wait on. What the
reduction keeps between steps belongs here too: the compressors' state (error-feedback
residuals, PowerSGD's Q), the bytes sent, the undo of a step skipped as non-finite, and
each rank's share of all that in checkpoints (keyed by the rank's place in the layout and
by its buckets' tensors). PyTorch puts the same behind one seam, DDP's communication hook.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import backend
from . import collectives as C
from .compress import Compressor, CompressSpec, Pending, all_reduce_bytes, make_compressor

Buffers = list[tuple[list[tuple[int, torch.Size]], int]]
"""Per buffer: the (offset, shape) of each tensor in it, and its length."""


class GradReducer:
    """Averages a strategy's gradient buffers over its data-parallel ``group``."""

    def __init__(self, spec: CompressSpec, buffers: Buffers, group: ProcessGroup | None = None,
                 device: torch.device | None = None, names: list[list[str]] | None = None,
                 ring: bool | None = None):
        self.spec, self.group, self.ring = spec, group, ring
        self.items = [make_compressor(spec, views, numel, seed=i, device=device)
                      for i, (views, numel) in enumerate(buffers)]
        # State fits only a buffer of the same tensors (names, offsets, shapes), not one of
        # another pipeline split or ZeRO stage that merely has as many entries.
        self.keys = [f"b{i}-{numel}" + (f"-{_digest(names[i], views)}" if names else "")
                     for i, (views, numel) in enumerate(buffers)]

    def __getitem__(self, index: int) -> Compressor:
        return self.items[index]

    # ---- reductions ---------------------------------------------------------------------------
    def average(self, index: int, buffer: torch.Tensor) -> Pending:
        """Launch the (compressed) average of buffer ``index`` in place over the group."""
        return self.items[index].reduce(buffer, self.group)

    def average_shard(self, index: int, buffer: torch.Tensor, shard: torch.Tensor) -> Pending:
        """Launch the average of buffer ``index`` such that ``shard``, this rank's slice of
        it, holds its part (ZeRO). Compressed, the whole buffer is averaged (stage 1 only,
        where the full gradient is kept: ``compress.check``)."""
        if self.spec.method != "none":
            return self.average(index, buffer)
        counter = self.items[index]
        nbytes = buffer.numel() * buffer.element_size()
        counter.dense_bytes += all_reduce_bytes(nbytes, C.size(self.group))
        counter.sent_bytes += backend.average_into_shard_bytes(nbytes, self.group, self.ring)
        return Pending(backend.average_into_shard(buffer, shard, self.group, self.ring))

    # ---- what outlives a step -----------------------------------------------------------------
    def pop_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes an uncompressed all-reduce would have sent) since the last call."""
        sent = sum(c.sent_bytes for c in self.items)
        dense = sum(c.dense_bytes for c in self.items)
        for c in self.items:
            c.sent_bytes = c.dense_bytes = 0
        return sent, dense

    def undo_step(self) -> None:
        """Forget the reductions of a step skipped as non-finite (``Compressor.undo``), so
        that its NaN does not poison the next steps."""
        for c in self.items:
            c.undo()

    def _prefix(self) -> str:
        place = self.spec.place or f"rank{dist.get_rank()}of{dist.get_world_size()}"
        return f"{self.spec.text}/{place}/"

    def local_state(self, extra: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This rank's reduction state under 'METHOD/PLACE/bI-N-TENSORS.NAME' (buffer I of
        N entries holding the named TENSORS, a digest), plus ``extra``, more of the rank's
        own state that the reduction made its own (the Adam moments of ``:update``), under
        'METHOD/PLACE/NAME'. No copy, no communication: sharded checkpoints write each
        rank's own."""
        prefix = self._prefix()
        return {**{f"{prefix}{key}.{k}": v for key, c in zip(self.keys, self.items)
                   for k, v in c.state_dict().items()},
                **{f"{prefix}{k}": v for k, v in (extra or {}).items()}}

    def load_state(self, saved: dict[str, torch.Tensor], group: ProcessGroup,
                   extra: Mapping[str, torch.Tensor] | None = None) -> str | None:
        """Install this rank's state (and ``extra``, in place) from the saved
        ``local_state`` of the rank that held the same place, if every rank of ``group``
        (the world: every rank reduces) finds its own: a checkpoint of another method,
        layout or bucket split leaves every rank's state fresh, never some (their
        reductions would no longer match). Returns the reason (None: restored, or nothing
        to restore)."""
        local = self.local_state(extra)
        if not local:
            return None
        missing = [key for key, value in local.items()
                   if key not in saved or saved[key].shape != value.shape]
        agreed = torch.tensor(0 if missing else 1, device=self.items[0].device)  # NCCL: on the GPU
        C.all_reduce(agreed, group, op="min")
        if missing or not agreed.item():
            first = f" (first missing here: {missing[0]})" if missing else " on another rank"
            return (f"the checkpoint holds no {self.spec.text} state for this rank's place in "
                    f"the layout and these buckets{first}")
        for key, c in zip(self.keys, self.items):
            prefix = f"{self._prefix()}{key}."
            c.load_state_dict({k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)})
        for key, value in (extra or {}).items():
            value.copy_(saved[self._prefix() + key])
        return None


def _digest(names: list[str], views: list[tuple[int, torch.Size]]) -> str:
    """A short fingerprint of a buffer's tensors: their names, offsets and shapes."""
    text = ";".join(f"{n}@{o}:{tuple(s)}" for n, (o, s) in zip(names, views))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
