"""The checkpoints a run directory holds: which are there, the newest complete one (what
``--resume auto`` takes), retention (``--keep-last``), and how a failed run goes on."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoint, publish
from .rundir import in_use

if TYPE_CHECKING:
    from .config import Config


def newest_complete(run_dir: Path, model_cfg, notes: list[str],
                    foreign: list | None = None) -> tuple[Path | None, int]:
    """The newest checkpoint of ``run_dir`` that verifies, and its step; each newer one that
    does not is named in ``notes``, and added to ``foreign`` when it is complete but of
    another model. (None, 0) when there is none."""
    if (Path(run_dir) / "checkpoints").is_dir() and not in_use(run_dir):  # not a live run's save
        folder = Path(run_dir) / "checkpoints"
        notes += publish.recover_replaced(folder) + publish.remove_unpublished(folder)
    for path in sorted(checkpoints(run_dir), key=step_of, reverse=True):
        try:
            meta, _ = checkpoint.verify(path, model_cfg)
        except checkpoint.CheckpointError as exc:
            notes.append(f"skipping {path.name}: {exc}")
            if foreign is not None and isinstance(exc, checkpoint.ModelMismatch):
                foreign.append(exc)
            continue
        return path, meta["step"]
    return None, 0


def published(run_dir: Path) -> list[Path]:
    """The checkpoints of ``run_dir`` whose index was written, oldest first (publishing is
    atomic, so each is whole unless damaged later), without reading their tensors."""
    return sorted((p for p in checkpoints(run_dir) if (p / checkpoint.INDEX).is_file()), key=step_of)


def keep_newest(run_dir: Path, n: int) -> list[Path]:
    """Remove all but the newest ``n`` published checkpoints of ``run_dir`` (``--keep-last``);
    the removed ones."""
    old = published(run_dir)[:-n] if n > 0 else []
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def how_to_resume(cfg: Config) -> str:
    """What a failed run leaves to go on from: its newest checkpoint and the command."""
    run_dir = Path(cfg.train.run_dir)
    newest = next(reversed(published(run_dir)), None)
    if newest is None:
        return (f"no checkpoint was written in {run_dir}" + ("" if cfg.train.save_every else
                " (pass --save-every N to keep some)"))
    return (f"last complete checkpoint: {newest}; continue with `paratrain train --config "
            f"{run_dir / 'config.toml'} --run-dir {run_dir} --resume auto`")


def checkpoints(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoints"
    return [p for p in folder.glob("step-*") if step_of(p) >= 0] if folder.is_dir() else []


def step_of(path: Path) -> int:
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else -1
