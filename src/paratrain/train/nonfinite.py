"""What a NaN or inf loss or gradient norm does: stop the run (default), or skip the step.

The loop checks the loss and gradient norm it already has on the host (no extra sync),
and on every rank alike, since both are reduced over the world. Only when one is not
finite does it ask which ranks' own losses were (one collective, on that rare path).
The step's update is never applied, so the weights, and any later checkpoint, stay finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import RunError


class NonFiniteError(RunError):
    """The loss or gradient norm became NaN or inf (and the policy says stop)."""


def culprits(local_loss: torch.Tensor) -> list[int]:
    """Global ranks whose own (unreduced) loss is not finite. Collective over the world."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, not math.isfinite(float(local_loss)))
    return [rank for rank, bad in enumerate(everyone) if bad]


@dataclass
class NonFiniteGuard:
    """Applies ``--on-nonfinite`` to each step whose loss or gradient norm was not finite."""

    policy: str
    """'stop' or 'skip'."""
    max_skips: int
    """Skipped steps allowed; the next non-finite one fails the run."""
    skips: int = 0

    def check(self, record: dict, last_checkpoint: str) -> NonFiniteError | None:
        """Count the step as skipped (None), or the error to stop with, naming the step, the
        ranks and the last good checkpoint (raised after the step's metrics are written)."""
        if self.policy == "skip" and self.skips < self.max_skips:
            self.skips += 1
            record["skipped"] = self.skips
            return None
        ranks = record["nonfinite_ranks"]
        where = (f"on rank {', '.join(map(str, ranks))}" if ranks else
                 "(every rank's own loss was finite: the gradient norm overflowed)")
        what = _what(record["loss"], record["grad_norm"])
        ckpt = last_checkpoint or "none (pass --save-every N to keep some)"
        fix = ("lower --lr, or pass --on-nonfinite skip" if self.policy == "stop" else
               f"it is the {self.skips + 1}th non-finite step, over --max-skips {self.max_skips}; lower --lr")
        return NonFiniteError(f"non-finite {what} at step {record['step']} {where}; its update was not "
                             f"applied. Last good checkpoint: {ckpt}. {fix[0].upper()}{fix[1:]}")


def _what(loss: float, norm: float) -> str:
    """'loss nan and grad norm nan', or the one that is not finite with the other's value."""
    values = {"loss": loss, "grad norm": norm}
    bad = [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]
    good = [f"the {name} {value:.4g} is finite" for name, value in values.items() if math.isfinite(value)]
    return " and ".join(bad) + (f" ({good[0]})" if good else "")
