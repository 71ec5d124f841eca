"""Sharded, layout-independent checkpoints you can trust (format 3; docs/checkpoints.md).

A checkpoint is a directory::

    rank-00000.safetensors  the slices rank 0 owns, e.g. "param/layers.0.attn.wq.weight@0,0"
    rank-00001.safetensors  ... one file per rank that owns something
    meta.json               the index, written last: {"format": 3, "step": N, "model": {...},
                            "layout": "...", "run": {...}, "data": {...},
                            "files": {file: {"bytes", "sha256"}},
                            "tensors": {"param/<name>": {"dtype", "shape",
                                        "slices": [{"file", "key", "offsets", "extents"}]}}}

Tensors are named and shaped as in the plain single-process model ("param/", "exp_avg/",
"exp_avg_sq/", plus each rank's own gradient-compression state under "compress/"). Each rank
writes only the boxes of them it owns (slices.py: its TP shard, its pipeline stage, its ZeRO
range of a flat unit; a replicated tensor once), streaming from its live tensors, so no rank
ever holds more than its own state plus one tensor. Loading under any other layout copies,
for every piece the rank holds, the intersecting boxes of the stored slices
(``safe_open(...).get_slice``): it reads only what it needs.

Trust: nothing non-finite is written; files go into a hidden temporary directory, each rank
fsyncs its file, rank 0 writes the index last (atomically) and renames the directory into
place (``publish.py``), so a checkpoint exists whole or not at all; a failed write on any
rank removes the temporary directory and raises a CheckpointError on every rank. Before launch ``verify``
checks the index (every tensor of the model, shapes, dtypes; the slices of each tensor tile
it exactly once) and every file's size and SHA-256, naming the first problem.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from .. import console
from ..parallel.engine import MOMENTS
from ..paths import is_plain_name
from . import publish as P
from . import slices as S
from .shardio import CheckpointError, Reader, Tensors, coverage_gap, file_digest, read_header, save_file
from .task import load_task, task_names

log = console.get(__name__)
FORMAT = 3
KINDS = ("param", *MOMENTS)
INDEX = "meta.json"
STATE = "state.safetensors"  # the one file of a checkpoint written by ``write``
DTYPES = ("float32", "bfloat16")
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
                      "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
"""Index dtype -> the name a safetensors header gives it."""


# ---- saving ------------------------------------------------------------------------------------
def save(directory: Path, step: int, engine, model_cfg, layout: str,
         run_meta: dict | None = None) -> None:
    """Every rank writes the slices it owns; rank 0 of the world writes the index and
    publishes the directory (collective). Raises CheckpointError on every rank if any
    rank failed."""
    directory, rank = Path(directory), dist.get_rank()
    tmp = directory.with_name(f".{directory.name}.tmp")
    agree(P.fresh(tmp, directory) if rank == 0 else "")
    error, record = "", None
    try:
        pieces = S.engine_pieces(engine, for_save=True)
        if pieces:
            record = _write_file(tmp, f"rank-{rank:05d}.safetensors", pieces, directory)
    except CheckpointError as exc:
        error = f"{exc} (on rank {rank})"
    except Exception as exc:  # noqa: BLE001  any failure must reach the gather below,
        error = f"{type(exc).__name__}: {exc} (on rank {rank})"  # or the others wait in it
    everyone: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((error, record), everyone, dst=0)  # only rank 0 holds the whole index
    outcome = next((e for e, _ in everyone if e), "") if rank == 0 else ""
    if rank == 0 and not outcome:
        meta = index_meta(step, model_cfg, layout, run_meta)
        outcome = P.commit(tmp, directory, INDEX, _index(meta, [r for _, r in everyone if r]))
    if rank == 0 and outcome:
        shutil.rmtree(tmp, ignore_errors=True)
    agree(outcome)


def index_meta(step: int, model_cfg, layout: str, run_meta: dict | None = None) -> dict:
    """What the index records besides the slices."""
    return {"format": FORMAT, "step": step, "model": dataclasses.asdict(model_cfg),
            "layout": layout, **(run_meta or {})}


def write(tensors: dict[str, torch.Tensor], directory: Path, meta: dict) -> None:
    """Write whole tensors as a one-file checkpoint (one process), atomically and durably,
    or raise CheckpointError leaving none."""
    directory = Path(directory)
    pieces = [S.Piece(k, tuple(v.shape), (0,) * v.dim(), v, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    tmp = directory.with_name(f".{directory.name}.tmp")
    error = P.fresh(tmp, directory)
    if not error:
        try:
            record = _write_file(tmp, STATE, pieces, directory)
            error = P.commit(tmp, directory, INDEX, _index({**meta, "format": FORMAT}, [record]))
        except CheckpointError as exc:
            error = str(exc)
    if error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(error)


def agree(error: str) -> None:
    """Rank 0's verdict on every rank (also: nobody goes on before the checkpoint is whole)."""
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise CheckpointError(error)


def _write_file(tmp: Path, name: str, pieces: list[S.Piece], directory: Path) -> dict:
    """One rank's file; returns what the index records of it."""
    for p in pieces:
        if p.local is not None and p.local.numel() and not _finite(p.local):
            raise CheckpointError(f"not writing checkpoint {str(directory)!r}: tensor {p.key!r} holds "
                                  f"NaN or inf")
    items = {_file_key(p.key, p.offsets): p for p in pieces}
    try:
        size, sha = save_file(items, tmp / name)
    except OSError as exc:
        raise CheckpointError(P.os_error(exc, directory)) from None
    return {"file": name, "bytes": size, "sha256": sha,
            "tensors": {p.key: [list(p.shape), _dtype(p.dtype)] for p in pieces},
            "slices": [[p.key, p.offsets, p.extents] for p in pieces]}


def _finite(t: torch.Tensor) -> bool:
    # aminmax propagates NaN and sees +-inf without the full-size temporaries of isfinite
    lo, hi = torch.aminmax(t) if t.is_floating_point() else (t.min(), t.max())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _file_key(key: str, offsets: tuple[int, ...]) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _index(meta: dict, records: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    for r in records:
        for key, offsets, extents in r["slices"]:
            shape, dtype = r["tensors"][key]
            entry = tensors.setdefault(key, {"dtype": dtype, "shape": shape, "slices": []})
            entry["slices"].append({"file": r["file"], "key": _file_key(key, offsets),
                                    "offsets": list(offsets), "extents": list(extents)})
    files = {r["file"]: {"bytes": r["bytes"], "sha256": r["sha256"]} for r in records}
    return {**meta, "files": files, "tensors": dict(sorted(tensors.items()))}


# ---- reading and checking ----------------------------------------------------------------------
def read_meta(directory: str | Path) -> dict:
    """The checkpoint's index, checked for completeness (every tensor's slices tile it once);
    raises CheckpointError naming the problem."""
    where, path = Path(directory), Path(directory) / INDEX
    if not path.is_file():
        if where.is_dir() and any(where.glob("*.safetensors")):
            raise CheckpointError(f"no checkpoint at {str(directory)!r}: its index {INDEX} is missing (the "
                                  f"index is written last, so that save never finished); resume from "
                                  f"another checkpoint")
        if (where / "checkpoints").is_dir():  # a run directory: what --resume auto reads
            raise CheckpointError(f"no checkpoint at {str(directory)!r} (no {INDEX}): it is a run "
                                  f"directory; continue its newest complete checkpoint with "
                                  f"--resume auto --run-dir {directory}, or give one of "
                                  f"{where / 'checkpoints'}/step-N")
        raise CheckpointError(f"no checkpoint at {str(directory)!r} (no {INDEX}); give the "
                              f"directory `paratrain train --save-every N` wrote, "
                              f"e.g. RUN_DIR/checkpoints/step-N")
    try:
        meta = json.loads(path.read_text())
        assert meta["format"] == FORMAT
        assert isinstance(meta["tensors"], dict) and isinstance(meta["files"], dict)
        boxes = {k: (tuple(v["shape"]), [(tuple(s["offsets"]), tuple(s["extents"])) for s in v["slices"]])
                 for k, v in meta["tensors"].items()}
        assert all(s["file"] in meta["files"] for v in meta["tensors"].values() for s in v["slices"])
    except (ValueError, KeyError, AssertionError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt or of an older format: "
                              f"{INDEX} is unreadable; resume from another checkpoint") from None
    _check_index(meta, directory)
    for key, (shape, tiles) in boxes.items():
        gap = coverage_gap(shape, tiles)
        if gap:
            raise CheckpointError(f"checkpoint {str(directory)!r} is incomplete: the slices of tensor "
                                  f"{key!r} do not cover it ({gap}); resume from another checkpoint")
    return meta


def _check_index(meta: dict, directory: str | Path) -> None:
    """The index is input: its checksum (``publish.seal``; indexes written before it have
    none) and every field a resume acts on, checked before any process starts."""
    where = f"checkpoint {str(directory)!r}: {INDEX}"
    sealed = meta.get(P.SEAL)
    if sealed is not None and sealed != P.index_digest(meta):
        raise CheckpointError(f"{where} was changed after it was written (its {P.SEAL} does not "
                              f"match its content); resume from another checkpoint")
    counters = {"step": meta["step"], "nonfinite.skipped": meta.get("nonfinite", {}).get("skipped", 0),
                **{f"data.{k}": meta.get("data", {}).get(k, 0) for k in ("step", "samples_seen")}}
    for name, value in counters.items():
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{where}: {name} is {json.dumps(value)}, not a count (an "
                                  f"integer >= 0); resume from another checkpoint")
    for name, info in meta["files"].items():
        if not is_plain_name(name):
            raise CheckpointError(f"{where} names the file {name!r}, which is not a plain file "
                                  f"name inside the checkpoint; an index may only name files beside it")
        if not (isinstance(info, dict) and type(info.get("bytes")) is int and isinstance(info.get("sha256"), str)):
            raise CheckpointError(f"{where}: the entry of {name} needs bytes and sha256")


class ModelMismatch(CheckpointError):
    """The checkpoint is complete, but of a model of another shape."""


def _task_of(fields: set[str]) -> tuple[str, str]:
    """(the kind of model, the task's name) whose model config has these fields."""
    for name in task_names():
        task = load_task(name)
        if {f.name for f in dataclasses.fields(task.model_type)} == fields:
            return task.model_kind, name
    return "a model of no known task", "its task"


def check_model(meta: dict, model_cfg, directory: str | Path) -> None:
    """Raise unless the checkpoint was made for a model of this shape."""
    mine = dataclasses.asdict(model_cfg)
    if set(meta["model"]) != set(mine):  # another task: its fields, not their values, differ
        theirs, ours = _task_of(set(meta["model"])), _task_of(set(mine))
        raise ModelMismatch(f"checkpoint {str(directory)!r} holds {theirs[0]}, and this run trains "
                            f"{ours[0]}; resume it with --task {theirs[1]}")
    diff = [f"{k}: {meta['model'].get(k)!r} in the checkpoint, {v!r} now"
            for k, v in mine.items() if meta["model"].get(k) != v]
    if diff:
        raise ModelMismatch(f"checkpoint {str(directory)!r} was saved for another model ({'; '.join(diff)}); "
                              f"resume with the same model settings")


def expected_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model holds, and its shape (no memory used)."""
    from ..models import param_shapes

    moments = {f"{kind}/{n}": shape for kind in MOMENTS
               for n, shape in param_shapes(model_cfg, trainable_only=True).items()}
    return {**{f"param/{n}": shape for n, shape in param_shapes(model_cfg).items()}, **moments}


def check_tensors(meta: dict, model_cfg, directory: str | Path) -> None:
    """Raise unless the index lists exactly the model's tensors, of its shapes and of a
    checkpoint dtype."""
    where = f"checkpoint {str(directory)!r}"
    want, recorded = expected_shapes(model_cfg), meta["tensors"]
    for name in sorted(set(want) | set(recorded)):
        if name not in recorded:
            raise CheckpointError(f"{where} lacks tensor {name!r}; resume from another checkpoint")
        if name.split("/", 1)[0] not in KINDS:  # an engine's own state (e.g. "compress/..."):
            continue  # checksummed with its file; the engine checks it fits when it loads it
        if name not in want:
            raise CheckpointError(f"{where} holds tensor {name!r}, which this model does not have")
        if recorded[name]["dtype"] not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {recorded[name]['dtype']}; "
                                  f"checkpoints hold {' or '.join(DTYPES)}")
        if tuple(recorded[name]["shape"]) != want[name]:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {recorded[name]['shape']}, "
                                  f"the model needs {list(want[name])}")


def check_file(directory: str | Path, name: str, info: dict) -> None:
    """Raise unless the file exists with the recorded size and SHA-256."""
    where, path = f"checkpoint {str(directory)!r}", Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"{where} is incomplete: {name} is missing; resume from another checkpoint")
    size, sha = file_digest(path)
    if size != info["bytes"]:
        raise CheckpointError(f"{where} is corrupt: {name} has {size} bytes, {INDEX} records "
                              f"{info['bytes']} (truncated?); resume from another checkpoint")
    if sha != info["sha256"]:
        raise CheckpointError(f"{where}: {name} has checksum {sha[:16]}, {INDEX} records "
                              f"{info['sha256'][:16]} (a corrupt file?); resume from another checkpoint")


def verify(directory: str | Path, model_cfg) -> tuple[dict, Mapping[str, torch.Tensor]]:
    """(index, tensors) of a checkpoint whose every tensor is present, of the model's shape
    and a checkpoint dtype, tiled by its slices, in files of the recorded size and checksum;
    else CheckpointError naming the first that is not. ``tensors`` reads each whole tensor
    when it is looked up (one at a time)."""
    meta = read_meta(directory)
    check_model(meta, model_cfg, directory)
    check_tensors(meta, model_cfg, directory)
    headers = {}
    for name, info in meta["files"].items():
        check_file(directory, name, info)
        try:
            headers[name] = read_header(Path(directory) / name)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {name} cannot be read "
                                  f"({exc}); resume from another checkpoint") from None
    for key, entry in meta["tensors"].items():
        for s in entry["slices"]:
            head = headers[s["file"]].get(s["key"])
            if head is None or head["shape"] != s["extents"]:
                raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {s['file']} lacks the "
                                      f"slice {s['key']!r} of tensor {key!r} its index lists")
            stored = SAFETENSORS_DTYPES.get(entry["dtype"], head["dtype"])
            if head["dtype"] != stored:  # else it would be cast silently as it is read
                raise CheckpointError(f"checkpoint {str(directory)!r} is corrupt: {s['file']} stores "
                                      f"slice {s['key']!r} as {head['dtype']}, its index says "
                                      f"{entry['dtype']}; resume from another checkpoint")
    return meta, Tensors(Path(directory), meta)


def _check_files_once(directory: str | Path, meta: dict) -> None:
    """Every file's size and SHA-256, each checked by one rank (round robin), the verdict
    shared: no rank reads more than its share of the checkpoint to check it (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    error = ""
    for name in sorted(meta["files"])[rank::world]:
        try:
            check_file(directory, name, meta["files"][name])
        except CheckpointError as exc:
            error = str(exc)
            break
    _raise_first(error)


def _raise_first(error: str, prefix: str = "") -> None:
    """Every rank's error ("" for none) gathered, the first raised on every rank
    (collective): a rank that failed alone must not leave the others waiting."""
    everyone: list = [""] * dist.get_world_size()
    dist.all_gather_object(everyone, error)
    first = next((e for e in everyone if e), "")
    if first:
        raise CheckpointError(prefix + first)


def load(directory: str | Path, model_cfg) -> tuple[int, dict[str, dict[str, torch.Tensor]]]:
    """(step, {"param": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}) of a verified
    checkpoint, every tensor whole (for tools: export, the U-Net task)."""
    meta, tensors = verify(directory, model_cfg)
    state: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}
    for key in tensors:
        kind, _, name = key.partition("/")
        state.setdefault(kind, {})[name] = tensors[key]  # engines may save more kinds ("compress")
    return meta["step"], state


def skipped_steps(meta: dict) -> int:
    """Steps of the saved run skipped as non-finite: counted by the loop, not applied by the
    optimizer (whose step count, and so Adam's bias correction, is this many behind)."""
    return int(meta.get("nonfinite", {}).get("skipped", 0))


@torch.no_grad()
def load_into(engine, directory: str | Path, model_cfg) -> int:
    """Fill this rank's parameters and Adam moments (any layout) from the checkpoint's
    slices, reading only the boxes the rank holds; returns the step (every rank calls it)."""
    meta = read_meta(directory)
    check_model(meta, model_cfg, directory)
    check_tensors(meta, model_cfg, directory)
    _check_files_once(directory, meta)
    S.prepare_optimizer_state(engine, meta["step"] - skipped_steps(meta))  # Adam's own count
    error, saved = "", {}
    try:
        saved = _read_pieces(engine, directory, meta)
    except Exception as exc:  # noqa: BLE001  every rank must hear of it, or the others wait
        error = f"{type(exc).__name__}: {exc} (on rank {dist.get_rank()})"  # in the first collective
    _raise_first(error, f"loading {str(directory)!r} failed: ")
    why = engine.load_rank_state(saved)  # all ranks restore, or none
    if why and any(k.startswith("compress/") for k in meta["tensors"]) and dist.get_rank() == 0:
        log.warning(f"paratrain train: gradient compression starts fresh: {why}; the resumed run "
                    "is not an exact continuation of the saved one")
    S.after_load(engine)
    return meta["step"]


def _read_pieces(engine, directory: str | Path, meta: dict) -> dict[str, torch.Tensor]:
    """This rank's boxes of every tensor; returns the gradient-compression state saved
    for this rank's place (installed once every rank has read its own)."""
    saved = {}
    with Reader(Path(directory), meta) as reader:
        for piece in S.engine_pieces(engine, for_save=False):
            reader.fill(piece)
        for key, value in engine.rank_state().items():
            entry = meta["tensors"].get(f"compress/{key}")
            if entry is not None and tuple(entry["shape"]) == tuple(value.shape):
                saved[key] = torch.empty_like(value)
                reader.fill(S.Piece(f"compress/{key}", tuple(value.shape), (0,) * value.dim(),
                                    saved[key], tuple(value.shape), value.dtype))
    return saved
