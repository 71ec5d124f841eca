"""The compressors of one engine's buckets together: byte counters, the undo of a skipped
step, and each rank's compression state in checkpoints (keyed by the rank's place in the
layout and by its buckets' tensors)."""

from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import collectives as C
from .compress import Compressor, CompressSpec, make_compressor


class CompressorSet:
    """The compressors of one engine's buckets, with byte counters and checkpoint state."""

    def __init__(self, spec: CompressSpec, buckets: list[tuple[list[tuple[int, torch.Size]], int]],
                 device: torch.device | None = None, names: list[list[str]] | None = None):
        self.spec = spec
        self.items = [make_compressor(spec, views, numel, seed=i, device=device)
                      for i, (views, numel) in enumerate(buckets)]
        # State fits only a bucket of the same tensors (names, offsets, shapes), not one of
        # another pipeline split or ZeRO stage that merely has as many entries.
        self.keys = [f"b{i}-{numel}" + (f"-{_digest(names[i], views)}" if names else "")
                     for i, (views, numel) in enumerate(buckets)]
        self.extra: Callable[[], dict[str, torch.Tensor]] = dict
        """More of this rank's own state to keep and restore with the compressors' (averaging
        AdamW's updates: the rank's Adam moments, parallel/local_update.py)."""

    def __getitem__(self, index: int) -> Compressor:
        return self.items[index]

    def pop_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes an uncompressed all-reduce would have sent) since the last call."""
        sent = sum(c.sent_bytes for c in self.items)
        dense = sum(c.dense_bytes for c in self.items)
        for c in self.items:
            c.sent_bytes = c.dense_bytes = 0
        return sent, dense

    def undo_step(self) -> None:
        """Forget the reductions of a step skipped as non-finite (``Compressor.undo``)."""
        for c in self.items:
            c.undo()

    def _prefix(self) -> str:
        place = self.spec.place or f"rank{dist.get_rank()}of{dist.get_world_size()}"
        return f"{self.spec.text}/{place}/"

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's compression state under 'METHOD/PLACE/bI-N-TENSORS.NAME' (bucket I of
        N entries holding the named TENSORS, a digest; no copy, no communication: sharded
        checkpoints write each rank's own)."""
        prefix = self._prefix()
        return {**{f"{prefix}{key}.{k}": v for key, c in zip(self.keys, self.items)
                   for k, v in c.state_dict().items()},
                **{f"{prefix}{k}": v for k, v in self.extra().items()}}

    def load_state(self, saved: dict[str, torch.Tensor], group: ProcessGroup) -> str | None:
        """Install this rank's state from the saved ``local_state`` of the rank that held the
        same place, if every rank of ``group`` (the world: every rank compresses) finds its own: a
        checkpoint of another method, layout or bucket split leaves every rank's state
        fresh, never some (their reductions would no longer match). Returns the reason
        (None: restored, or nothing to restore)."""
        local = self.local_state()
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
        for key, value in self.extra().items():
            value.copy_(saved[self._prefix() + key])
        return None


def _digest(names: list[str], views: list[tuple[int, torch.Size]]) -> str:
    """A short fingerprint of a bucket's tensors: their names, offsets and shapes."""
    text = ";".join(f"{n}@{o}:{tuple(s)}" for n, (o, s) in zip(names, views))
    return hashlib.sha256(text.encode()).hexdigest()[:12]
