"""Where one GPU training step's peak memory goes, against the planner's count of it.

    python benchmarks/gpu_memory.py [--micro-batch 2] [--recompute none] [--d-model 2048]
                                    [--n-layers 16] [--seq-len 2048] [--precision bf16]

Needs a CUDA GPU. Builds the Llama-shaped model of ``plan_vs_gpu.py``, runs one step (the
optimizer states appear), then the second step under a dispatch mode that tracks every
storage alive (tests/test_plan_peaks.py's ``PeakStorage``), naming the operator that made
each. Prints ``torch.cuda.max_memory_allocated`` over the second step, the tracked peak,
the planner's ``rank_memory(paratrain=True)`` with its parts, and the storages alive at
the tracked peak summed by operator, dtype and shape. The last line is a JSON object:
"paratrain" = the planner's peak bytes, "peer" = the measured allocator peak, "ratio".
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_plan_peaks import PeakStorage  # noqa: E402

from paratrain.launch import spawn  # noqa: E402
from paratrain.mesh import Mesh  # noqa: E402
from paratrain.layout import Layout  # noqa: E402
from paratrain.plan.candidate import Candidate, Training  # noqa: E402
from paratrain.plan.memory import rank_memory  # noqa: E402
from paratrain.plan.models import from_gpt_config  # noqa: E402
from paratrain.train import loop  # noqa: E402

import plan_vs_gpu  # noqa: E402
from common import at_least  # noqa: E402


class NamedPeak(PeakStorage):
    """``PeakStorage`` that also remembers which operator made each storage, and what was
    alive when the peak was reached."""

    def __init__(self, tensors):
        self.made: dict[int, str] = {}
        self.at_peak: list[tuple[str, int]] = []
        super().__init__(tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                self.made.setdefault(ref.cdata, f"{func.__name__} {tuple(t.shape)} {t.dtype}")
        if self.peak > before:
            self.at_peak = [(self.made.get(key, "?"), n) for key, (_, n) in self.created.items()]
        return out


def probe(cfg) -> dict:
    mesh = Mesh.build(cfg.layout)
    run = loop.build(cfg, mesh)
    loop.train_step(run, 0)
    state = run.engine.state_tensors()
    tensors = [t for group in state.values() for t in group if t is not None]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with NamedPeak(tensors) as mode:
        loop.train_step(run, 1)
    torch.cuda.synchronize()
    by_op = collections.Counter()
    for name, n in mode.at_peak:
        by_op[name] += n
    return {"allocator_peak": torch.cuda.max_memory_allocated(), "tracked_peak": mode.peak,
            "start": mode.start, "top": by_op.most_common(25)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=at_least(1), default=2)
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--d-model", type=at_least(1), default=2048)
    parser.add_argument("--n-layers", type=at_least(1), default=16)
    parser.add_argument("--seq-len", type=at_least(1), default=2048)
    parser.add_argument("--global-batch", type=at_least(1), default=8)
    args = parser.parse_args()
    args.steps = 2
    cfg = plan_vs_gpu.build_config(args, "/tmp/gpu-memory", {
        "micro_batch": args.micro_batch, "recompute": args.recompute,
        "precision": args.precision})
    got = spawn(probe, 1, cfg, backend="nccl", timeout_s=600)[0]
    model = from_gpt_config(cfg.model, "bench")
    training = Training(cfg.train.global_batch, cfg.data.seq_len, cfg.train.precision)
    cand = Candidate(Layout(), zero=0, micro_batch=cfg.micro_batch,
                     microbatches=cfg.accumulation, recompute=cfg.train.recompute)
    mem = rank_memory(model, training, cand, paratrain=True, backend="nccl")
    gib = 2**30
    print(f"mb{args.micro_batch} {args.recompute} {args.precision}: allocator peak "
          f"{got['allocator_peak'] / gib:.2f} GiB, tracked peak {got['tracked_peak'] / gib:.2f}"
          f" (states at start {got['start'] / gib:.2f}); planner {mem.total / gib:.2f} = params "
          f"{mem.params / gib:.2f} + grads {mem.grads / gib:.2f} + optimizer "
          f"{mem.optimizer / gib:.2f} + activations {mem.activations / gib:.2f} + buffers "
          f"{mem.buffers / gib:.2f}")
    print("alive at the tracked peak, by the operator that made them:")
    for name, n in got["top"]:
        print(f"  {n / gib:>7.3f} GiB  {name}")
    print(json.dumps({"benchmark": "gpu_memory", "paratrain": int(mem.total),
                      "peer": got["allocator_peak"],
                      "ratio": round(mem.total / got["allocator_peak"], 4),
                      "tracked_peak": got["tracked_peak"]}))


if __name__ == "__main__":
    main()
