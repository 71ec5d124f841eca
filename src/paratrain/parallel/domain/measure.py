"""Exact activation memory: the bytes autograd keeps for backward."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], torch.Tensor],
                           exclude: Iterable[torch.Tensor] = ()) -> tuple[torch.Tensor, int]:
    """Run ``fn`` (a forward pass) and return (its result, the bytes of the distinct storages
    autograd saved for backward), leaving out ``exclude`` (the parameters): views of one
    buffer count once, so a slice of an input that is saved whole costs nothing extra."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())
