"""Tasks: what differs between training one kind of model and another (a language model,
a U-Net on fields).

One loop (loop.py) drives every task. A task owns what the loop cannot know: how to build
the model and its engine (or resume them), how to cut this rank's microbatches from sample
indices, how many loss units (tokens, grid points) a global batch holds, validation, the
shape its checkpoints carry, and the lines that describe it. Everything else (steps, the
non-finite rule, metrics and their sinks, the profiler, peak memory, checkpoints, the
summary) is the loop's, so every task has it. A new task is a new file, ``task_NAME.py``,
whose ``TASK`` class implements ``Task`` (``--task NAME`` finds it), and optionally a
settings module ``NAME.py`` whose ``SECTION`` dataclass is the run config's ``[NAME]``
table (``SECTION_TITLE``: its help title): no change to the loop or the config.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from ..mesh import Mesh
from ..parallel.engine import Engine
from . import data as D

if TYPE_CHECKING:  # the config asks the tasks to validate it: no import back
    from .config import Config

PREFIX = "task_"
"""A task named NAME is the module ``task_NAME`` of this package."""


@cache
def task_names() -> tuple[str, ...]:
    """Every task this package holds (its ``task_*.py`` modules), sorted."""
    package = importlib.import_module(__package__).__path__
    return tuple(sorted(m.name[len(PREFIX):] for m in pkgutil.iter_modules(package)
                        if m.name.startswith(PREFIX)))


@cache
def task_sections() -> dict[str, tuple[type, str]]:
    """The config tables tasks add: name -> (its dataclass, its help title), from each
    task's settings module ``NAME.py`` (a light module: no model, no torch.distributed)."""
    found = {}
    for name in task_names():
        if importlib.util.find_spec(f"{__package__}.{name}") is None:
            continue
        settings = importlib.import_module(f".{name}", __package__)
        if getattr(settings, "SECTION", None) is not None:
            found[name] = (settings.SECTION, getattr(settings, "SECTION_TITLE", name))
    return found


@dataclass
class Run:
    """Everything the steps of one rank share."""

    cfg: Config
    mesh: Mesh
    task: "Task"
    engine: Engine
    """The parallel model, its optimizer and its step (parallel/engine.py)."""
    train_data: Any
    """The task's training samples (``D.Samples`` for the language model)."""
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

    reads_corpus: bool
    """Whether it trains on ``[data]``'s corpus or dataset (checked before launch)."""
    spatial: bool
    """Whether its samples have spatial axes that domain parallelism (--domain) cuts."""
    model_type: type
    """The dataclass of its model's shape (what its checkpoints record)."""
    model_kind: str
    """Its model in words ("a language model"), for errors naming another task's checkpoint."""

    def validate(self, cfg: Config) -> None:
        """Raise ConfigError for a setting this task cannot run or would not read."""


def task_for(cfg: Config) -> Task:
    """A fresh ``Task`` for ``cfg.train.task``."""
    return load_task(cfg.train.task)


def load_task(name: str) -> Task:
    """A fresh ``Task`` named ``name`` (``task_names``)."""
    if name not in task_names():
        raise ValueError(f"task {name!r}: the tasks are {', '.join(task_names())}")
    return importlib.import_module(f".{PREFIX}{name}", __package__).TASK()
