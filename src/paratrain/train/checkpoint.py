"""Layout-independent checkpoints you can trust: full tensors under the plain model's names.

A checkpoint is a directory::

    meta.json           {"format": 2, "step": N, "model": {GPTConfig fields}, "layout": "...",
                         "run": {"id", "seed", "config"}, "data": {where the data stream is},
                         "tensors": {name: {"dtype", "shape", "sha256"}}}
    state.safetensors   "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>"

Every tensor is stored whole, as the plain single-process model names and shapes it, so
any layout can resume from it: parameters are loaded into the plain model *before* it is
parallelized (which then cuts each rank's share, as it does from a fresh initialisation),
and the engine installs its share of Adam's moments.

Trust: rank 0 refuses to write a non-finite tensor; it writes into a hidden temporary
directory, fsyncs the files and the directory, renames it into place and fsyncs the parent,
so a checkpoint exists whole or not at all, even across a power cut. A failed write (full
disk, read-only directory) removes the temporary directory and raises a CheckpointError.
Loading checks every tensor against the model (names, shapes) and against meta.json
(dtype, shape, checksum) and names the first one that differs.

(Simpler than per-rank slice files: all tensors pass through rank 0, which suits models
whose full state fits in one host's memory.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..errors import RunError
from ..parallel.engine import MOMENTS

FORMAT = 2
KINDS = ("param", *MOMENTS)
STATE = "state.safetensors"
DTYPES = ("float32", "bfloat16")


class CheckpointError(RunError, ValueError):
    """A checkpoint that is missing, corrupt, made for another model, or cannot be
    written; the message names the tensor or file and says what to do."""


def save(directory: Path, step: int, engine, model_cfg, layout: str, is_writer: bool,
         run_meta: dict | None = None) -> None:
    """Gather the full state (collective: every rank calls it) and write it on rank 0.
    Raises CheckpointError on every rank if rank 0 could not write it."""
    tensors = {f"param/{k}": v for k, v in engine.full_state_dict().items()}
    for kind, named in engine.full_optimizer_state().items():
        tensors.update({f"{kind}/{k}": v for k, v in named.items()})
    outcome = [""]
    if is_writer:
        meta = {"format": FORMAT, "step": step, "model": dataclasses.asdict(model_cfg),
                "layout": layout, **(run_meta or {})}
        try:
            write({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, directory, meta)
        except CheckpointError as exc:
            outcome = [str(exc)]
    dist.broadcast_object_list(outcome, src=0)  # also: nobody reads it before it is complete
    if outcome[0]:
        raise CheckpointError(outcome[0] if is_writer else f"rank 0 could not save: {outcome[0]}")


def write(tensors: dict[str, torch.Tensor], directory: Path, meta: dict) -> None:
    """Write a checkpoint atomically and durably, or raise CheckpointError leaving none."""
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"not writing checkpoint {str(directory)!r}: tensor {bad[0]!r} holds "
                              f"NaN or inf ({len(bad)} such tensors)")
    meta = {**meta, "tensors": {k: describe(v) for k, v in tensors.items()}}
    tmp = directory.with_name(f".{directory.name}.tmp")
    old = directory.with_name(f".{directory.name}.old")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / STATE))
        _fsync(tmp / STATE)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # last: marks it complete
        _fsync(tmp / "meta.json")
        _fsync(tmp)
        if directory.exists():
            directory.rename(old)
        os.rename(tmp, directory)
        _fsync(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not directory.exists():
            old.rename(directory)
        raise CheckpointError(f"could not write checkpoint {str(directory)!r}: {exc.strerror or exc} "
                              f"({exc.filename or directory}); nothing was left half-written. Free "
                              f"space or choose a writable --run-dir") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "sha256": checksum(tensor)}


def checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.data).hexdigest()


def read_meta(directory: str | Path) -> dict:
    """The checkpoint's metadata; raises CheckpointError naming the problem."""
    path = Path(directory) / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(directory)!r} (no meta.json); give the "
                              f"directory `paratrain train --save-every N` wrote, "
                              f"e.g. RUN_DIR/checkpoints/step-N")
    try:
        meta = json.loads(path.read_text())
        assert meta["format"] == FORMAT and isinstance(meta["step"], int)
        assert isinstance(meta["tensors"], dict)
    except (ValueError, KeyError, AssertionError, TypeError):
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt or of an older format: "
                              f"meta.json is unreadable; resume from another checkpoint") from None
    return meta


def check_model(meta: dict, model_cfg, directory: str | Path) -> None:
    """Raise unless the checkpoint was made for a model of this shape."""
    mine = dataclasses.asdict(model_cfg)
    diff = [f"{k}: {meta['model'].get(k)!r} in the checkpoint, {v!r} now"
            for k, v in mine.items() if meta["model"].get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {str(directory)!r} was saved for another model ({'; '.join(diff)}); "
                              f"resume with the same model settings")


def expected_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model holds, and its shape (no memory used)."""
    from ..models.gpt import GPT, GPTConfig
    from ..models.unet import UNet

    with torch.device("meta"):
        model = GPT(model_cfg) if isinstance(model_cfg, GPTConfig) else UNet(model_cfg)
    return {f"{kind}/{n}": tuple(p.shape) for kind in KINDS for n, p in model.named_parameters()}


def verify(directory: str | Path, model_cfg) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, tensors) of a checkpoint whose every tensor is present, of the model's shape,
    of the recorded dtype and checksum; else CheckpointError naming the first that is not."""
    meta = read_meta(directory)
    check_model(meta, model_cfg, directory)
    where = f"checkpoint {str(directory)!r}"
    want, recorded = expected_shapes(model_cfg), meta["tensors"]
    for name in sorted(set(want) | set(recorded)):
        if name not in recorded:
            raise CheckpointError(f"{where} lacks tensor {name!r}; resume from another checkpoint")
        if name.split("/", 1)[0] not in KINDS:  # an engine's own state (e.g. "compress/..."):
            continue  # checksummed below; the engine checks it fits when it loads it
        if name not in want:
            raise CheckpointError(f"{where} holds tensor {name!r}, which this model does not have")
        if recorded[name]["dtype"] not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {recorded[name]['dtype']}; "
                                  f"checkpoints hold {' or '.join(DTYPES)}")
        if tuple(recorded[name]["shape"]) != want[name]:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {recorded[name]['shape']}, "
                                  f"the model needs {list(want[name])}")
    path = Path(directory) / STATE
    if not path.is_file():
        raise CheckpointError(f"{where} is incomplete: {STATE} is missing; resume from another checkpoint")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises its own types for truncated/garbled files
        raise CheckpointError(f"{where} is corrupt: {STATE} cannot be read ({exc}); "
                              f"resume from another checkpoint") from None
    for name in sorted(set(tensors) | set(recorded)):
        if name not in tensors:
            raise CheckpointError(f"{where} is incomplete: tensor {name!r} is missing from {STATE}")
        if name not in recorded:
            raise CheckpointError(f"{where}: {STATE} holds tensor {name!r}, which meta.json does not list")
        got, rec = describe(tensors[name]), recorded[name]
        for key, what in (("dtype", "dtype"), ("shape", "shape"), ("sha256", "checksum")):
            if got[key] != rec[key]:
                raise CheckpointError(f"{where}: tensor {name!r} has {what} {str(got[key])[:16]}, "
                                      f"meta.json records {str(rec[key])[:16]} (a corrupt file?); "
                                      f"resume from another checkpoint")
    return meta, tensors


def load(directory: str | Path, model_cfg) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    """(step, {"param": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}) of a verified checkpoint."""
    meta, tensors = verify(directory, model_cfg)
    state: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key, value in tensors.items():
        kind, _, name = key.partition("/")
        state.setdefault(kind, {})[name] = value  # engines may save more kinds ("compress")
    return meta["step"], state
