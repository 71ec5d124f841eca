"""Regional compilation (``--compile``): each transformer block, and the loss, through
``torch.compile``, as torchtitan does, after the model is parallelized.

What is compiled is each block's ``forward`` (replaced on the instance, as activation
recomputation replaces it: parallel/recompute.py), not the module's ``__call__``. So:

- Module hooks stay outside the compiled regions and run eagerly around them: ZeRO-3's
  gather before a block's forward and its free after, and the per-parameter
  post-accumulate-grad hooks of DDP and ZeRO, which autograd fires when it accumulates a
  gradient into ``.grad``: after the compiled backward of the block has returned, not
  inside it. Nothing of the data-parallel reduction is traced.
- Parameters stay the module's own ``nn.Parameter`` objects (dynamo reads them as graph
  inputs): the optimizer steps exactly the tensors the compiled block computes with, and
  a ZeRO-3 unit can free and regather their storage between calls.
- Whatever tensor parallelism, sequence parallelism or context parallelism put inside a
  block (its region operators, the ring attention core) is traced with the block; the
  operators that talk to other ranks are kept out of the graph (``EAGER_OPS``) and run
  eagerly between its compiled parts.

Every block of a model has the same code and, with ``dynamic=False``, the same shapes,
so the blocks share one compiled graph (and the loss one more); a pipeline rank's chunks
share them too. The compile time is torch's own count (``compile_seconds``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def eager(fn: Callable) -> Callable:
    """Keep ``fn`` out of every compiled graph: a compiled region that calls it is split
    there, runs ``fn`` eagerly and resumes (dynamo counts one graph break per split). For
    the operators that talk to other ranks inside a block (tensor parallelism's region
    entries and exits, context parallelism's attention): their collectives are launched
    asynchronously and awaited by hand, which dynamo does not trace."""
    return torch._dynamo.disable(fn, recursive=True)


def compile_forward(module: nn.Module, fullgraph: bool = True) -> None:
    """Replace ``module.forward`` with its ``torch.compile``d self (inductor, static
    shapes). ``fullgraph``: a graph break is an error, not a silent split."""
    module.forward = torch.compile(module.forward, dynamic=False, fullgraph=fullgraph)


def compile_regions(blocks: Iterable[nn.Module], losses: Iterable[nn.Module],
                    fullgraph: bool = True) -> int:
    """Compile every block and loss module in place; returns how many regions."""
    regions = [*blocks, *losses]
    for module in regions:
        compile_forward(module, fullgraph)
    return len(regions)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's tracing, AOTAutograd and
    inductor, forward and backward graphs), as torch counts them."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
