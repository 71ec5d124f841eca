"""paratrain: distributed training of PyTorch models with every parallelism strategy."""

from .layout import Layout, LayoutError

__version__ = "0.1.0"
__all__ = ["Layout", "LayoutError", "__version__"]
