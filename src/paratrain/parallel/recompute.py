"""Activation recomputation: keep fewer activations, redo the forward during backward.

- ``full``: each transformer block keeps only its input; the whole block is recomputed.
- ``selective``: only the attention core (softmax(QK^T)V, whose activations grow with the
  square of the sequence) is recomputed; the linear layers keep their activations
  (Korthikanti et al., 2022).

The module's ``forward`` is replaced on the instance, so parameter names do not change and
hooks attached to the module (ZeRO-3's gather/free) run once around the outer call, not
again during the recomputation, which calls the original ``forward`` directly.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

POLICIES = ("none", "selective", "full")


def _recompute(module: nn.Module) -> None:
    original = module.forward

    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(blocks: Iterable[nn.Module], policy: str, core: str = "attn.core") -> None:
    """Make the blocks (or their attention cores, at path ``core`` in each block: the
    model description's ``attention_core``) recompute their forward in backward."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r} is not one of {', '.join(POLICIES)}")
    for block in blocks if policy != "none" else []:
        _recompute(block if policy == "full" else block.get_submodule(core))
