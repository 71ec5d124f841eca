"""Layout-independent checkpoints: full tensors under the plain model's names.

A checkpoint is a directory::

    meta.json           {"format": 1, "step": N, "model": {GPTConfig fields}, "layout": "..."}
    state.safetensors   "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"

Every tensor is stored whole, as the plain single-process model names and shapes it, so
any layout can resume from it: parameters are loaded into the plain model *before* it is
parallelized (which then cuts each rank's share, as it does from a fresh initialisation),
and the engine installs its share of Adam's moments. Rank 0 writes into a temporary
directory and renames it into place, so a checkpoint exists whole or not at all.

(Simpler than per-rank slice files: all tensors pass through rank 0, which suits models
whose full state fits in one host's memory.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..parallel.engine import MOMENTS

FORMAT = 1
KINDS = ("param", *MOMENTS)


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt or made for another model; says what to do."""


def save(directory: Path, step: int, engine, model_cfg, layout: str, is_writer: bool) -> None:
    """Gather the full state (collective: every rank calls it) and write it on rank 0."""
    tensors = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    for kind, named in engine.full_optimizer_state().items():
        tensors.update({f"{kind}/{k}": v for k, v in named.items()})
    if is_writer:
        _write(directory, {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
               {"format": FORMAT, "step": step, "model": dataclasses.asdict(model_cfg), "layout": layout})
    dist.barrier()  # nobody reads a checkpoint before it is complete


def _write(directory: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "state.safetensors"))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    old = directory.with_name(f".{directory.name}.old")
    if directory.exists():
        directory.rename(old)
    os.rename(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | Path) -> dict:
    """The checkpoint's metadata; raises CheckpointError naming the problem."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {directory!r} (no meta.json); give the "
                              f"directory `paratrain train --save-every N` wrote, "
                              f"e.g. RUN_DIR/checkpoints/step-N")
    try:
        meta = json.loads(path.read_text())
        assert meta["format"] == FORMAT and isinstance(meta["step"], int)
    except (ValueError, KeyError, AssertionError, TypeError):
        raise CheckpointError(f"checkpoint {directory!r} is corrupt: meta.json is unreadable; "
                              f"resume from another checkpoint") from None
    return meta


def check_model(meta: dict, model_cfg, directory: str | Path) -> None:
    """Raise unless the checkpoint was made for a model of this shape."""
    mine = dataclasses.asdict(model_cfg)
    diff = [f"{k}: {meta['model'].get(k)!r} in the checkpoint, {v!r} now"
            for k, v in mine.items() if meta["model"].get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {directory!r} was saved for another model ({'; '.join(diff)}); "
                              f"resume with the same model settings")


def load(directory: str | Path, model_cfg) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    """(step, {"param": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}) of a checkpoint."""
    meta = read_meta(directory)
    check_model(meta, model_cfg, directory)
    try:
        tensors = load_file(str(Path(directory) / "state.safetensors"))
    except Exception as exc:  # safetensors raises its own types for truncated/garbled files
        raise CheckpointError(f"checkpoint {directory!r} is corrupt: state.safetensors cannot be "
                              f"read ({exc}); resume from another checkpoint") from None
    state: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, value in tensors.items():
        kind, _, name = key.partition("/")
        state.setdefault(kind, {})[name] = value  # engines may save more kinds ("compress")
    return meta["step"], state
