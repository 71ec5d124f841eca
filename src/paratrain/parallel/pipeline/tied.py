"""A tied embedding under a pipeline: the first stage embeds with the tensor, the last
projects onto the vocabulary with it, and they are different ranks.

As Megatron does it, the last stage keeps a copy of its own (``split_model`` unties it),
equal at the start because both are filled from the one tensor of the plain model. After
each step's backward the two ends add their gradients over the *embedding group* (the
first and the last rank of every pipeline group), before the data-parallel reduction, so
both copies get the gradient the tied tensor would get and stay equal under the same
optimizer. The copy is not a parameter of the plain model: it is counted once in the
gradient norm, not saved, and loaded from the embedding's slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ...comm import collectives as C


@dataclass
class TiedEnds:
    """This rank's end of a tied embedding under a pipeline."""

    param: nn.Parameter
    """The embedding (first stage) or the head's copy of it (last stage)."""
    group: ProcessGroup
    """The embedding group: the first and the last rank of this pipeline."""
    is_copy: bool
    """Whether ``param`` is the last stage's copy (not saved, not counted in the norm)."""
    name: str
    """The tied tensor's name in the plain model (the embedding's)."""

    @torch.no_grad()
    def sync_grad(self) -> None:
        """Add the two ends' gradients (collective over the embedding group)."""
        if self.param.grad is not None:
            C.all_reduce(self.param.grad, self.group)


def untie(chunks: list[nn.Module], head: str) -> nn.Parameter | None:
    """Give the last stage's head a weight of its own, a copy of the tied tensor (meta
    stays meta: it is filled with the rest); returns it, or None on other ranks."""
    for chunk in chunks:
        if chunk.is_last:
            module = chunk.get_submodule(head)
            module.weight = nn.Parameter(module.weight.detach().clone())
            return module.weight
    return None


def tied_ends(chunks: list[nn.Module], desc, group: ProcessGroup | None) -> TiedEnds | None:
    """This rank's end of the tied embedding, or None (untied model, or a middle stage)."""
    if group is None:
        return None
    name = f"{desc.embedding}.weight"
    for chunk in chunks:
        if chunk.is_first:
            return TiedEnds(chunk.get_submodule(desc.embedding).weight, group, False, name)
        if chunk.is_last:
            return TiedEnds(chunk.get_submodule(desc.head).weight, group, True, name)
    return None
