"""Tasks: what differs between training a language model and the heat2d U-Net.

One loop (loop.py) drives every task. A task owns what the loop cannot know: how to build
the model and its engine (or resume them), how to cut this rank's microbatches from sample
indices, how many loss units (tokens, grid points) a global batch holds, validation, the
shape its checkpoints carry, and the lines that describe it. Everything else (steps, the
non-finite rule, metrics and their sinks, the profiler, peak memory, checkpoints, the
summary) is the loop's, so every task has it. A third task is a new ``task_*.py`` file
whose ``TASK`` class implements ``Task``, and a line in ``TASKS``: no change to the loop.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..mesh import Mesh
from ..parallel.engine import Engine
from . import data as D

if TYPE_CHECKING:  # the config asks the tasks to validate it: no import back
    from .config import Config

TASKS = {"lm": "task_lm", "heat2d": "task_heat2d"}
"""``train.task`` -> the module (in this package) that defines its ``Task``."""


@dataclass
class Run:
    """Everything the steps of one rank share."""

    cfg: Config
    mesh: Mesh
    task: "Task"
    engine: Engine
    """The parallel model, its optimizer and its step (parallel/engine.py)."""
    train_data: Any
    """The task's training samples (``D.Samples``, heat2d's ``Fields``)."""
    val_data: Any
    """Its validation samples."""
    sampler: D.DistributedSampler
    start_step: int = 0
    """Steps already taken (a resumed run starts there)."""
    run_id: str = ""
    """This run's identity, kept by its checkpoints (a resumed run keeps the one it resumes)."""
    last_checkpoint: str = ""
    """The newest checkpoint this run wrote or resumed from."""
    skipped: int = 0
    """Steps skipped as non-finite before ``start_step`` (kept by checkpoints)."""

    @property
    def is_logger(self) -> bool:
        return self.mesh.rank == 0


class Task(Protocol):
    """What the loop asks of a task (see the module doc)."""

    def build(self, cfg: Config, mesh: Mesh) -> Run:
        """This rank's engine with its share of the weights (resumed from
        ``cfg.train.resume`` when set), its data and sampler."""

    def microbatches(self, run: Run, data: Any, indices: list[int]) -> list[tuple]:
        """This data-parallel rank's samples ``indices`` of ``data``, as the engine's
        microbatches."""

    def count(self, run: Run, step: int) -> int:
        """Loss units (tokens, grid points) in the global batch of ``step``: each rank's
        summed loss is divided by it, so gradients are those of the global mean."""

    def evaluate(self, run: Run) -> float | None:
        """The validation loss (collective), or None where there is no validation data."""

    def describe(self, run: Run) -> str:
        """The lines printed at the start of a run."""

    def model_config(self, cfg: Config) -> Any:
        """The shape its checkpoints carry and are checked against."""

    def model_label(self, cfg: Config) -> str:
        """The model's name in the logs' run config (TensorBoard, W&B)."""

    def flops_per_unit(self, cfg: Config) -> float:
        """Training FLOPs per loss unit, for MFU; 0 where not counted."""

    def data_position(self, cfg: Config, step: int) -> dict | None:
        """What a checkpoint records of the data read so far (None: nothing to record)."""


def task_for(cfg: Config) -> Task:
    """A fresh ``Task`` for ``cfg.train.task``."""
    module = importlib.import_module(f".{TASKS[cfg.train.task]}", __package__)
    return module.TASK()
