"""Run directories, and restarts that need no typing.

Where a run writes (``train.run_dir``):

- given (``--run-dir DIR``): exactly DIR; ``runs/latest`` is left alone;
- not given: a new ``runs/<UTC time>-<name>`` (``--name``, default the model preset), and
  ``runs/latest`` becomes a symlink to it.

What it resumes (``train.resume``): a checkpoint directory; ``none``; or ``auto``, the
default under torchrun: the newest *complete* checkpoint (every tensor verified against its
SHA-256) of the run directory, which is DIR when given, else the run ``runs/latest`` points
at. An incomplete checkpoint is skipped with a note. With nothing to resume in
``runs/latest`` (no complete checkpoint, another model, or the run already finished) a new
run directory is started; in a given DIR, nothing to resume means a fresh start there, and
a finished run, or another model's checkpoints, are refused. A fresh run (no ``--resume``)
never overwrites another run's records: a DIR holding its metrics or checkpoints, or an
existing ``--metrics`` file, is refused. A restarted torchrun job thus finds the run its first attempt
started, whether ``--run-dir`` was given or not.

The launcher decides all this once, before any rank starts (under torchrun, global rank 0
decides and the other ranks receive its decision), and records ``config.toml`` (the
resolved config, which ``paratrain train --config`` reads back) and ``versions.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import __version__, console
from ..models import hf
from ..optim import lr_at
from ..paths import write_atomic
from . import checkpoint
from .config import CORE, Config, ConfigError
from .metrics import json_record_step, read_lines
from .rundir import in_use, records_owner
from .saved import checkpoints, newest_complete, step_of

log = console.get(__name__)
ROOT = Path("runs")
LATEST = "latest"
RESUME_CHOICES = ("auto", "none")
"""``train.resume`` values that are not a checkpoint directory."""


def resume_mode(resume: str, torchrun: bool) -> str:
    """'auto', 'none' or a checkpoint directory; '' means auto under torchrun, else none."""
    return resume or ("auto" if torchrun else "none")


def place(cfg: Config, torchrun: bool, now: float | None = None,
          job: "Job | None" = None) -> tuple[Config, list[str]]:
    """``cfg`` with a concrete run directory and resume checkpoint ('' : fresh), and the notes
    to print. Creates a new run directory (and points ``runs/latest`` at it) when one is needed.
    ``job``: the torchrun job this is an attempt of; a restart continues the run its first
    attempt started, whatever ``runs/latest`` points at by then."""
    _check_metrics_path(cfg.train.metrics)
    cfg = absolute_paths(cfg)
    mode = resume_mode(cfg.train.resume, torchrun)
    # A checkpoint named through runs/latest: resolved now, before latest moves to a new run.
    given = "" if mode in RESUME_CHOICES else os.path.realpath(mode)
    explicit = bool(cfg.train.run_dir)
    run_dir: Path | None = Path(cfg.train.run_dir) if explicit else None
    notes: list[str] = []
    owned = explicit  # the directory is this run's own, not runs/latest's guess
    if job is not None and job.attempt > 0:
        mode = "auto"  # a restart continues its own run, whatever its first attempt resumed
        if not explicit:
            run_dir = job.run_dir()
            owned = run_dir is not None
            if run_dir is None:
                notes.append(f"torchrun restarted job {job.name} (attempt {job.attempt}), but its "
                             f"first attempt recorded no run directory in {JOBS}: starting a new "
                             f"run (runs/latest may be another job's)")
    elif not explicit and mode == "auto" and (ROOT / LATEST).is_dir():
        latest = ROOT / LATEST
        run_dir = latest.parent / os.readlink(latest) if latest.is_symlink() else latest
    resume = given
    if mode == "auto" and run_dir is not None:
        run_dir, resume = _auto(cfg, run_dir, owned, given, notes)
    if resume:
        meta = checkpoint.read_meta(resume)
        notes += data_changes(meta, cfg) + schedule_changes(meta, cfg)
        if run_dir is not None:
            _refuse_cutting_records(run_dir, resume, meta)
    elif mode == "none":
        _refuse_overwrite(cfg, run_dir if explicit else None)
    if run_dir is None:
        run_dir = new_run_dir(cfg.train.name or default_name(cfg), now)
    if job is not None:
        job.record(run_dir)
    train = dataclasses.replace(cfg.train, run_dir=str(run_dir), resume=resume)
    return dataclasses.replace(cfg, train=train), notes


def _auto(cfg: Config, run_dir: Path, owned: bool, given: str,
          notes: list[str]) -> tuple[Path | None, str]:
    """``--resume auto`` in ``run_dir``: (the run directory, the checkpoint to resume). A
    directory that is not ``owned`` (runs/latest's) with nothing to resume gives way to a
    new run (None); an owned one is started fresh in, or resumes ``given`` (what the first
    attempt of a restarted job resumed)."""
    where = str(run_dir) if owned else f"{ROOT / LATEST} ({run_dir.name})"
    foreign: list[checkpoint.ModelMismatch] = []
    found, step = newest_complete(run_dir, model_config(cfg), notes, foreign)
    if found is not None and step >= cfg.train.steps:
        if owned:
            raise ConfigError(f"the run in {str(run_dir)!r} finished: its newest checkpoint is "
                              f"at step {step}, and steps={cfg.train.steps}; raise --steps to "
                              f"train further, or choose another --run-dir")
        notes.append(f"{where} finished at step {step}: starting a new run")
        return None, ""
    if found is not None:
        notes.append(f"resuming {found} (step {step})")
        return run_dir, str(found)
    if not owned:
        notes.append(f"no complete checkpoint in {where}: starting a new run")
        return None, ""
    if foreign:  # complete, but another model's: starting fresh would overwrite that run
        raise ConfigError(f"{str(run_dir)!r} holds a run of another model, which a fresh "
                          f"run there would overwrite ({foreign[0]}); choose another --run-dir")
    if not given:
        _refuse_finished_records(run_dir)
    notes.append(f"no complete checkpoint in {where}: " + (f"resuming {given}" if given else "starting fresh"))
    return run_dir, given


def absolute_paths(cfg: Config) -> Config:
    """``cfg`` with the files it reads (a dataset, a corpus, a Hugging Face model directory)
    named by absolute path: the run's config.toml and its checkpoints keep them, and
    ``export`` or a resume run from another directory must find the same files."""
    data = cfg.data
    absolute = {k: os.path.abspath(v) for k in ("data", "corpus") if (v := getattr(data, k))}
    preset = os.path.abspath(cfg.model_preset) if hf.is_model_dir(cfg.model_preset) else cfg.model_preset
    return dataclasses.replace(cfg, data=dataclasses.replace(data, **absolute), model_preset=preset)


JOBS = ROOT / ".jobs"
"""Where each torchrun job records the run directory its first attempt placed."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One attempt of a torchrun job: its identity (``launch.job_identity``) and how many
    times torchrun restarted it before."""

    name: str
    """The same in every attempt of the job, and in no other job."""
    attempt: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: 0 for the first attempt."""

    @property
    def path(self) -> Path:
        digest = hashlib.sha256(self.name.encode()).hexdigest()[:16]  # any run id makes a file name
        return JOBS / f"{digest}.json"

    def run_dir(self) -> Path | None:
        """The run directory this job's first attempt placed, or None if it recorded none."""
        try:
            recorded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(recorded, dict) or recorded.get("job") != self.name:
            return None
        return Path(recorded["run_dir"]) if isinstance(recorded.get("run_dir"), str) else None

    def record(self, run_dir: Path) -> None:
        JOBS.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"job": self.name, "run_dir": str(run_dir)}) + "\n")


RECORDS = ("metrics.jsonl", "metrics.csv")
"""What a run writes into its directory that a fresh run there would overwrite."""


def _check_metrics_path(metrics: str) -> None:
    """--metrics names a file that can be made: not a directory, nor under a file."""
    if not metrics:
        return
    path = Path(metrics)
    if path.is_dir():
        raise ConfigError(f"--metrics {metrics!r} is a directory; give a file path, e.g. "
                          f"{str(path / 'metrics.jsonl')!r}")
    existing = next((parent for parent in path.parents if parent.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"--metrics {metrics!r}: {str(existing)!r} is a file, so no directory "
                          f"can be made there; choose a path under a directory")


def _refuse_overwrite(cfg: Config, run_dir: Path | None) -> None:
    """A fresh run must not overwrite another run's records: its metrics file truncated,
    or its checkpoints left beside the new records for a later resume to mix with them."""
    metrics = Path(cfg.train.metrics) if cfg.train.metrics else None
    if metrics is not None and metrics.exists():
        raise ConfigError(f"--metrics {str(metrics)!r} exists (another run's records), and a fresh "
                          f"run would overwrite it; choose another path, or remove it")
    if run_dir is None or not run_dir.is_dir() or in_use(run_dir):  # the lock says which run
        return
    held = [name for name in RECORDS if (run_dir / name).exists()]
    held += sorted((p.name for p in checkpoints(run_dir)), key=lambda n: step_of(Path(n)))
    if held:
        raise ConfigError(f"the run directory {str(run_dir)!r} holds another run's "
                          f"{', '.join(held)}, which a fresh run there would overwrite or mix with; "
                          f"resume it with --resume auto, choose another --run-dir, or remove them")


def _refuse_finished_records(run_dir: Path) -> None:
    """``--resume auto`` into a directory without checkpoints starts fresh there: right for a
    run killed before its first save (a torchrun restart), not over one that finished, whose
    metrics would be truncated."""
    metrics, config = run_dir / "metrics.jsonl", run_dir / "config.toml"
    if in_use(run_dir) or not (metrics.is_file() and config.is_file()):
        return
    try:
        steps = tomllib.loads(config.read_text())["train"]["steps"]
    except (tomllib.TOMLDecodeError, KeyError, OSError):
        return
    logged = (json_record_step(line) for line in read_lines(metrics))
    done = max((step for step in logged if step != math.inf), default=0)  # torn lines: inf
    if done >= steps:
        raise ConfigError(f"the run in {str(run_dir)!r} finished (its metrics.jsonl reaches step "
                          f"{done} of steps={steps}) without a checkpoint to resume; starting "
                          f"fresh there would overwrite its records: choose another --run-dir, "
                          f"or remove them")


def _refuse_cutting_records(run_dir: Path, resume: str, meta: dict) -> None:
    """A resumed run keeps its directory's records up to the step it resumes and drops the
    rest: they must be the resumed run's own. ``run.json`` names their run; records that
    predate it are taken as the run's whose checkpoint lies in the same directory."""
    held = [name for name in RECORDS if (run_dir / name).exists()]
    if not held or in_use(run_dir):  # the lock names a live run
        return
    owner = records_owner(run_dir)
    if owner is not None:
        ours = owner == meta.get("run", {}).get("id")
    else:
        ours = Path(resume).resolve().is_relative_to(run_dir.resolve())
    if ours:
        return
    whose = f"run {owner}'s" if owner else "another run's"
    raise ConfigError(f"the run directory {str(run_dir)!r} holds {whose} {', '.join(held)}, which "
                      f"resuming {resume!r} there would cut back to step {meta['step']}; resume "
                      f"into another --run-dir (or none: a new one is made), or remove them")


def data_changes(meta: dict, cfg: Config) -> list[str]:
    """A note when the resumed run reads its data otherwise than the saved run did: the
    sampler's order is a function of (seed, global batch, data settings, step), so a change
    repeats or skips samples against the uninterrupted run (allowed: a batch-size ramp
    changes it on purpose)."""
    saved = meta.get("data")
    if not saved:  # a checkpoint from before the data position was kept
        return []
    now = cfg.data_order()
    notes = []
    if saved.get("data") == now["data"] and saved.get("dataset", now.get("dataset")) != now.get("dataset"):
        notes.append(f"the dataset at {now['data']} holds other data than the saved run read (its "
                     f"identity is {now['dataset']}, the checkpoint's {saved['dataset']}: prepared "
                     f"again?): the position the checkpoint recorded, {saved.get('samples_seen', '?')} "
                     f"samples, means nothing in it; prepare it again from the same text to "
                     f"continue the saved run, or go on knowing the data is new")
    changed = [f"{k}={now[k]!r} (saved: {saved[k]!r})" for k in now
               if k in saved and saved[k] != now[k] and k != "dataset"]
    if changed:
        notes.append(f"resuming with {', '.join(changed)}: the batches after step {saved['step']} "
                     f"are not the ones the saved run would have read next")
    return notes


SCHEDULE = ("lr", "min_lr", "warmup_steps")
"""The optimizer settings ``lr_at`` reads, besides the run's ``steps``."""


def schedule_changes(meta: dict, cfg: Config) -> list[str]:
    """A note when the resumed run's learning-rate schedule differs from the saved run's:
    the cosine decay spans ``--steps``, so extending a run (as a finished run's refusal
    suggests) stretches what is left of it."""
    saved = meta.get("run", {}).get("config")
    if not saved:  # a checkpoint from before the config was kept
        return []
    was = SimpleNamespace(steps=saved["train"]["steps"], **{k: saved["optim"][k] for k in SCHEDULE})
    now = SimpleNamespace(steps=cfg.train.steps, **{k: getattr(cfg.optim, k) for k in SCHEDULE})
    changed = [f"{k}={getattr(now, k)!r} (saved: {getattr(was, k)!r})" for k in ("steps", *SCHEDULE)
               if getattr(now, k) != getattr(was, k)]
    if not changed:
        return []
    step = meta["step"]
    return [f"resuming with {', '.join(changed)}: the learning rate from step {step + 1} follows "
            f"the new schedule ({lr_at(step, now.steps, now):.3g}, where the saved run's was "
            f"{lr_at(step, was.steps, was):.3g})"]


def place_and_print(cfg: Config, torchrun: bool, job: Job | None = None) -> Config:
    """``place``, with its notes and the run directory printed."""
    cfg, notes = place(cfg, torchrun, job=job)
    for note in notes:
        log.info(f"paratrain train: {note}")
    log.info(f"run directory {cfg.train.run_dir}")
    return cfg


def model_config(cfg: Config):
    """The shape a checkpoint of this run must have (its task's model)."""
    from .task import task_for  # here: the tasks import the engines, and runs is read first

    return task_for(cfg).model_config(cfg)


def default_name(cfg: Config) -> str:
    """The model preset, or a Hugging Face directory's name."""
    if cfg.train.task != "lm":
        return cfg.train.task
    return Path(cfg.model_preset).name if hf.is_model_dir(cfg.model_preset) else cfg.model_preset


def new_run_dir(name: str, now: float | None = None) -> Path:
    """Create ``runs/<UTC time>-<name>`` (``-2``, ``-3``... if taken) and point
    ``runs/latest`` at it."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    base = f"{stamp}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}"
    ROOT.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = ROOT / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        point_latest(path)
        return path
    raise ConfigError(f"could not create a run directory {ROOT / base}-N; pass --run-dir")


def point_latest(path: Path) -> None:
    """Make ``runs/latest`` a relative symlink to ``path``, atomically. A real directory
    named latest (from an older paratrain) is left as it is."""
    latest = path.parent / LATEST
    if latest.exists() and not latest.is_symlink():
        return
    tmp = path.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.name)
    os.replace(tmp, latest)


def record(cfg: Config) -> None:
    """Write the resolved config (``config.toml``) and the versions into the run directory."""
    from ..plan.export import to_toml

    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    comment = ("The resolved config of this run; `paratrain train --config` reads it back.\n"
               "run_dir and resume are left out: it starts a new run.")
    write_atomic(run_dir / "config.toml", to_toml(config_tables(cfg), comment))
    write_atomic(run_dir / "versions.json", json.dumps(versions(), indent=1) + "\n")


def config_tables(cfg: Config) -> dict[str, dict]:
    """Every field of ``cfg`` by TOML table (the run's place and resume left out)."""
    shape = {} if hf.is_model_dir(cfg.model_preset) else dataclasses.asdict(cfg.model)  # its config.json
    tables = {"model": {"preset": cfg.model_preset, **shape}}
    for section in CORE:
        tables[section] = dataclasses.asdict(getattr(cfg, section))
    tables.update({name: dataclasses.asdict(table) for name, table in cfg.tasks.items()})
    for key in ("run_dir", "resume", "metrics"):
        tables["train"].pop(key)
    # dp follows from nproc and the other sizes: left to derive, so that `--config` with
    # another --nproc or --tp re-derives it instead of contradicting the file's dp
    tables["parallel"]["dp"] = 0
    return tables


def versions() -> dict[str, str]:
    return {"paratrain": __version__, "torch": torch.__version__, "python": platform.python_version()}


