"""ZeRO stages 1-3: sharded optimizer state, gradients and parameters."""

from .engine import ZeroDataParallel

__all__ = ["ZeroDataParallel"]
