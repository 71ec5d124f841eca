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
  block (its region operators, the ring attention core) is traced with the block, except
  the operators that talk to other ranks: those run eagerly between its compiled parts
  (``compile_regions``' ``eager``). They are marked only when compiling: importing
  ``torch._dynamo`` costs a second, which ``paratrain train --help`` should not pay.

Every block of a model has the same code and, with ``dynamic=False``, the same shapes,
so the blocks share one compiled graph (and the loss one more); a pipeline rank's chunks
share them too. The compile time is torch's own count (``compile_seconds``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def compile_forward(module: nn.Module, fullgraph: bool = True) -> None:
    """Replace ``module.forward`` with its ``torch.compile``d self (inductor, static
    shapes). ``fullgraph``: a graph break is an error, not a silent split."""
    module.forward = torch.compile(module.forward, dynamic=False, fullgraph=fullgraph)


def compile_regions(blocks: Iterable[nn.Module], losses: Iterable[nn.Module],
                    eager: Iterable[tuple[object, str]] = ()) -> int:
    """Compile every block and loss module in place; returns how many regions.

    ``eager``: (object, method name) of the operators inside the blocks that talk to other
    ranks (tensor parallelism's region entry and exit, context parallelism's attention
    core). They launch collectives asynchronously and wait on them by hand, which dynamo
    does not trace, so each is replaced on its instance by ``torch.compiler.disable`` of
    itself: a block that calls one is compiled in parts, the call running eagerly between
    them (dynamo counts a graph break there). Without any, a graph break is an error."""
    eager = list(eager)
    for obj, name in eager:
        setattr(obj, name, torch.compiler.disable(getattr(obj, name)))
    regions = [*blocks, *losses]
    for module in regions:
        compile_forward(module, fullgraph=not eager)
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
