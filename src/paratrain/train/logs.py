"""What a run tells the people watching it, besides ``metrics.jsonl`` (the source of truth):
extra metric sinks, progress on the terminal or as plain log lines, the model FLOP
utilisation, per-rank peak memory, and a profiler window.

Sinks share one small interface, ``write(record)`` and ``close()``, and see the same
records as the JSON lines: ``--log csv,tensorboard`` (and ``wandb`` where installed).
"""

from __future__ import annotations

import contextlib
import csv
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from .. import console

log = console.get(__name__)

SINKS = ("csv", "tensorboard", "wandb")
CSV_COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens", "tokens_per_s",
               "step_time_s", "mfu", "peak_mem_bytes_max", "param_bytes", "grad_bytes",
               "optim_bytes")


class Sink(Protocol):
    """Receives every metrics record of the run, on the logging rank."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def parse_sinks(text: str) -> tuple[str, ...]:
    """``"csv,tensorboard"`` -> ("csv", "tensorboard"); ValueError names the unknown ones
    and what is missing to use the known ones."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown log sink(s) {unknown}: pick from {', '.join(SINKS)}")
    for name, module, install in (("tensorboard", "tensorboard", "pip install tensorboard"),
                                  ("wandb", "wandb", "pip install wandb")):
        if name in names and not _importable(module):
            raise ValueError(f"--log {name} needs the {module} package: {install}")
    return names


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


class CsvSink:
    """One row per record, fixed columns (empty where a record has no value)."""

    def __init__(self, path: Path, append: bool = False, resume_step: int | None = None):
        if resume_step is not None:  # a resumed run: keep the rows up to its step, append
            from .metrics import keep_records_until

            keep_records_until(path, resume_step)
            append = True
        new = not (append and path.exists())
        self._file = open(path, "a" if append else "w", newline="")
        self._writer = csv.DictWriter(self._file, CSV_COLUMNS, extrasaction="ignore")
        if new:
            self._writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        row = dict(record)
        if record.get("peak_mem_bytes"):
            row["peak_mem_bytes_max"] = max(record["peak_mem_bytes"])
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars under train/, val/ and memory/, by step (torch's SummaryWriter)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            if key == "peak_mem_bytes":
                for rank, b in enumerate(value):
                    self._writer.add_scalar(f"memory/peak_bytes_rank{rank}", b, step)
            elif isinstance(value, (int, float)):
                tag = "val/loss" if key == "val_loss" else f"train/{key}"
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, offline (``wandb sync`` uploads later) unless the user configured
    wandb's own mode."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb

        mode = None if "WANDB_MODE" in os.environ else "offline"  # wandb's own setting wins
        self._run = wandb.init(dir=str(run_dir), config=config, mode=mode, project="paratrain")

    def write(self, record: dict[str, Any]) -> None:
        self._run.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                      step=record["step"])

    def close(self) -> None:
        self._run.finish()


def make_sinks(names: tuple[str, ...], run_dir: Path, config: dict[str, Any],
               append: bool = False, resume_step: int | None = None) -> list[Sink]:
    sinks: list[Sink] = []
    for name in names:
        if name == "csv":
            sinks.append(CsvSink(run_dir / "metrics.csv", append, resume_step))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        else:
            sinks.append(WandbSink(run_dir, config))
    return sinks


# ---- model FLOP utilisation -------------------------------------------------------------


def flops_per_token(n_layers: int, d_model: int, seq_len: int, matmul_params: int) -> float:
    """Training FLOPs per token of a decoder (PaLM, Chowdhery et al. 2022, appendix B):
    6 per weight of every matrix multiply (forward 2, backward 4), plus 12 · layers ·
    d_model · seq for the attention scores and their weighted sum. Recomputation is not
    counted: MFU measures the model's work, not the work a strategy adds."""
    return 6 * matmul_params + 12 * n_layers * d_model * seq_len


def peak_flops(device: torch.device, precision: str, world: int) -> float | None:
    """What the run's processes could reach together: on CPU the matmul rate measured by
    ``paratrain plan --cluster local --calibrate`` times the busy cores, on a GPU its
    datasheet peak (the planner's presets), None when unknown."""
    if device.type == "cuda":
        from ..plan.hardware import preset_for_device

        gpu = preset_for_device(torch.cuda.get_device_name(device))
        if gpu is None:
            return None
        return (gpu.peak_flops if precision == "bf16" else gpu.peak_flops_fp32) * world
    from ..plan.hardware import CalibrationError, load_calibration

    try:
        calibration = load_calibration()
    except (CalibrationError, ValueError):
        return None
    rate = calibration.matmul_flops.get(precision, calibration.matmul_flops.get("fp32"))
    return rate * min(world, calibration.cores) if rate else None


def peak_memory_kind(device: torch.device) -> str:
    """What ``peak_memory_bytes`` measures on ``device``, as the metrics name it."""
    return "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated device memory on a GPU; on CPU the peak
    resident set (Linux reports KiB), which includes the allocator's retained heap."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- progress -------------------------------------------------------------------------


class Progress:
    """A tqdm bar on a terminal; elsewhere (a file, a pipe, CI) a plain line every
    ``every`` steps, so redirected output stays readable."""

    def __init__(self, total: int, start: int, enabled: bool, every: int):
        self.total, self.every, self.enabled = total, every, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        elif self.enabled and (record["step"] % self.every == 0 or record["step"] == self.total):
            log.info(log_line(record, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log_line(record: dict[str, Any], total: int) -> str:
    parts = [f"step {record['step']}/{total}", f"loss {record['loss']:.4f}"]
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"grad_norm {record['grad_norm']:.3f}",
              f"{record['tokens_per_s']:,.0f} tok/s"]
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    return time.strftime("%H:%M:%S ") + "  ".join(parts)


# ---- profiler -------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileWindow:
    """Steps ``start`` to ``end`` (1-based, inclusive) recorded by torch.profiler."""

    start: int
    end: int

    @classmethod
    def parse(cls, text: str, steps: int) -> "ProfileWindow | None":
        """``"5:8"`` -> steps 5 to 8; '' -> None. ValueError names the fix."""
        if not text:
            return None
        try:
            start, end = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"profile={text!r}: write START:END, e.g. 5:8") from None
        if not 1 <= start <= end <= steps:
            raise ValueError(f"profile={text!r}: need 1 <= START <= END <= steps={steps}")
        return cls(start, end)


class Profiler:
    """Starts torch.profiler before step ``start`` and writes a Chrome trace per rank
    (``profile-rank{N}.json``, open in chrome://tracing or Perfetto) after step ``end``."""

    def __init__(self, window: ProfileWindow | None, run_dir: Path, rank: int, device: torch.device):
        self.window, self.path, self._prof = window, run_dir / f"profile-rank{rank}.json", None
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)

    def before(self, step: int) -> None:
        if self.window is not None and step == self.window.start:
            self._prof = torch.profiler.profile(activities=self.activities, record_shapes=True)
            with quiet_stderr():
                self._prof.__enter__()

    def after(self, step: int) -> Path | None:
        if self._prof is None or step != self.window.end:
            return None
        with quiet_stderr():
            self._prof.__exit__(None, None, None)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        return self.path


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Drop what native code writes to file descriptor 2 meanwhile: the profiler's C++
    side (kineto) prints "profiler_start" / "profiler_stop" lines there, which no logging
    level reaches. A Python exception still propagates; the run reports it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
