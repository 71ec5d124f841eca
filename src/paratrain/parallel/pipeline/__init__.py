"""Pipeline parallelism: stages of layers on different ranks, microbatches flowing through.

* ``schedules``: GPipe, 1F1B and interleaved 1F1B as pure tables of actions per rank;
  ``zero_bubble``: the orders of ZB-H1, ZBV and DualPipeV (B and W: a split backward).
* ``split``: a chunk's backward as B (input gradient) and later W (weight gradients).
* ``posting``: when a rank's transfers are posted and waited for, and the buffers held.
* ``simulator``: executes tables with given costs (bubble, peak in-flight microbatches,
  deadlock check). Like ``schedules``, ``posting`` and ``timeline``, no torch.
* ``partition``: split a built GPT into each rank's chunks (virtual stages).
* ``executor``: run any table with batched non-blocking point-to-point transfers.
* ``timeline``: what each rank did when, recorded or simulated; the measured bubble.

Typical use on each rank of a pipeline group::

    chunks = split_model(model, pp_rank, pp, virtual_stages=v)
    table = schedule("1f1b", pp, microbatches, v)[pp_rank]
    loss = run_schedule(table, chunks, microbatches, pp_group, loss_scale, device,
                        act_shape=(micro_batch, seq, d_model))
"""

import importlib

from .schedules import (Action, ScheduleError, check, dump_tables, forward_schedule, load_tables,
                        notes, peak_inflight, schedule)
from .simulator import Simulation, simulate
from .timeline import Interval, Recorder, Timeline, theoretical_bubble

# The executor and the partition need torch; they are imported on first use, so the
# planner can read tables and simulate them without importing torch.
_LAZY = {"run_schedule": ".executor", "gather_timeline": ".executor",
         "PipelineChunk": ".partition", "split_layers": ".partition", "split_model": ".partition"}

__all__ = ["Action", "Interval", "PipelineChunk", "Recorder", "ScheduleError", "Simulation",
           "Timeline", "check", "dump_tables", "forward_schedule", "load_tables", "gather_timeline", "notes",
           "peak_inflight", "run_schedule", "schedule", "simulate", "split_layers",
           "split_model", "theoretical_bubble"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
