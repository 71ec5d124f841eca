"""What a run reports: per-rank state bytes, JSON-lines metrics, the closing summary."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import torch

from ..accounting import storage_bytes
from ..errors import RunError
from ..paths import write_atomic


def state_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state, from the tensors an
    engine holds (``engine.state_tensors()``): exact whatever the strategy shards."""
    return {"param_bytes": storage_bytes(tensors["params"]),
            "grad_bytes": storage_bytes(tensors["grads"]),
            "optim_bytes": storage_bytes(tensors["optim"])}


def comm_metrics(engine) -> dict[str, float]:
    """This step's data-parallel bytes sent by this rank (``comm_bytes``: gradients, or
    AdamW's updates under ``:update``) and the compression ratio against uncompressed
    all-reduces (``comm_ratio``; ZeRO's reduce-scatters count as all-reduces), experts'
    gradients over their own group included."""
    sent, dense = engine.reducer.pop_bytes()
    experts = getattr(engine, "expert_reducer", None)  # expert parallelism only
    if experts is not None:
        sent, dense = (a + b for a, b in zip((sent, dense), experts.pop_bytes()))
    return {"comm_bytes": sent, "comm_ratio": dense / sent if sent else 1.0}


class MetricsWriter:
    """Appends one strict-JSON object per line (a NaN or inf is written as null, which every
    JSON reader accepts); only the rank that owns it writes. A run resumed at step N
    (``resume_step``) keeps the file's records up to step N and appends after them."""

    def __init__(self, path: Path | None, resume_step: int | None = None):
        self.path = path
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                keep_records_until(path, resume_step)
            self._file = open(path, "a" if resume_step is not None else "w")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(strict(record), allow_nan=False) + "\n"
        end = self._file.tell()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:  # a full disk: no torn line is left, and the failure is named
            self._file = _cut_back(self._file, self.path, end)
            raise MetricsError(f"could not write {self.path} at step {record.get('step')}: "
                               f"{exc.strerror or exc}; its records end at the step before. Free "
                               f"space and continue with --resume auto") from None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class MetricsError(RunError):
    """The metrics file could not be written (a full disk, a read-only file system)."""


def _cut_back(file, path: Path, end: int):
    """``file`` closed, and ``path`` cut back to ``end`` bytes (a partial line removed);
    None, so that nothing more is written to it."""
    try:
        file.close()
    except OSError:
        pass  # the close's own flush of the torn line fails the same way
    try:
        with open(path, "r+b") as f:
            f.truncate(end)
    except OSError:
        pass
    return None


def read_lines(path: Path) -> list[str]:
    """The lines of a records file whose tail may be torn (a power loss mid-write): bytes
    that are not UTF-8 become U+FFFD, so a torn line fails to parse and is dropped by the
    reader, instead of the whole file failing to decode."""
    return path.read_text(errors="replace").splitlines(keepends=True)


def keep_records_until(path: Path, step: int) -> None:
    """Drop the records after ``step`` from a metrics file (JSON lines, or CSV with a header
    and a ``step`` column): a killed run logged steps that its resumed run takes again, and
    each step must appear once. Atomic: the file is whole before or after."""
    if not path.is_file():
        return
    lines = read_lines(path)
    if path.suffix == ".csv":
        column = next(csv.reader(lines[:1]), ["step"]).index("step")
        kept = lines[:1] + [ln for ln in lines[1:] if _csv_step(ln, column) <= step]
    else:
        kept = [ln for ln in lines if json_record_step(ln) <= step]
    write_atomic(path, "".join(ln if ln.endswith("\n") else ln + "\n" for ln in kept))


def _csv_step(line: str, column: int) -> float:
    row = next(csv.reader([line]), [])
    return _int(row[column]) if column < len(row) else math.inf


def json_record_step(line: str) -> float:
    """The step of one metrics.jsonl line (inf for a torn or stepless one)."""
    try:
        return _int(json.loads(line).get("step"))
    except (ValueError, AttributeError):
        return math.inf


def _int(value: Any) -> float:
    try:
        return int(value)
    except (TypeError, ValueError):
        return math.inf  # a record without a step (a torn last line): not kept


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def summary(records: list[dict[str, Any]], per_rank: list[dict[str, int]], wall_s: float,
            compile_s: float | None = None) -> str:
    """The closing report: first and final loss, throughput, wall time, memory per rank;
    with ``compile_s`` (``--compile``), the seconds this rank spent compiling."""
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    timed = steps[1:] or steps  # the first step pays one-off warm-up costs
    tok_s = sum(r["tokens"] for r in timed) / max(1e-9, sum(r["step_time_s"] for r in timed))
    lines = [
        f"steps         {len(steps)}  (loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f})",
    ]
    if evals:
        lines.append(f"val loss      {evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})")
    if any(r.get("comm_bytes") for r in steps):  # no data-parallel reduction: nothing to say
        sent = sum(r["comm_bytes"] for r in steps) / len(steps)
        dense = sum(r["comm_bytes"] * r["comm_ratio"] for r in steps) / len(steps)
        # Gradients, or AdamW's updates under --compress METHOD:update: name neither.
        lines.append(f"dp traffic    {human_bytes(sent)} sent per step and rank "
                     f"(compression ratio {dense / max(sent, 1e-9):.1f}x)")
    if "expert_load" in steps[-1]:  # a mixture of experts: how evenly the last step routed
        last = steps[-1]
        dropped = sum(r.get("dropped_tokens", 0) for r in steps)
        lines.append(f"experts       busiest {last['expert_load']:.2f}x the mean load, aux loss "
                     f"{last['aux_loss']:.4f} (last step); {dropped:,} assignments dropped")
    if compile_s is not None:  # paid in the first step (and the first evaluation), not later
        lines.append(f"compile       {compile_s:.1f} s (torch.compile of the blocks and the loss, "
                     f"rank 0; within the train time)")
    lines += [f"throughput    {tok_s:,.0f} tokens/s", f"train time    {wall_s:.1f} s (the steps, evaluations and checkpoints)",
              "memory/rank   params / grads / optimizer state"]
    for rank, b in enumerate(per_rank):
        lines.append(f"  rank {rank:<4}   {human_bytes(b['param_bytes'])} / "
                     f"{human_bytes(b['grad_bytes'])} / {human_bytes(b['optim_bytes'])}")
    return "\n".join(lines)
