"""Exact memory accounting: bytes of the storages behind tensors."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once;
    a freed storage counts zero)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            key = storage.data_ptr() or id(storage)  # freed storages have no address
            seen[key] = storage.nbytes()
    return sum(seen.values())
