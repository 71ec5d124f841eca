"""File-level pieces of sharded checkpoints: a streaming safetensors writer, header and
checksum reading, and the check that a tensor's slices cover it exactly once.

The writer streams tensor by tensor from the rank's live storage (no byte copy of the
payload, unlike ``safetensors.torch.save_file``, which serialises every tensor to bytes
first) and hashes what it writes, so the file's SHA-256 costs no second read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import RunError
from .slices import Box, Piece, intersect

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
CHUNK = 16 << 20  # bytes read at a time when hashing a file


class CheckpointError(RunError, ValueError):
    """A checkpoint that is missing, corrupt, made for another model, or cannot be
    written; the message names the tensor or file and says what to do."""


def save_file(pieces: dict[str, Piece], path: str | Path) -> tuple[int, str]:
    """Write ``pieces`` (file key -> piece) as one safetensors file; fsync it. Returns
    (bytes, sha256)."""
    header, pos = {}, 0
    for key, p in pieces.items():
        n = math.prod(p.extents) * torch.empty((), dtype=p.dtype).element_size()
        header[key] = {"dtype": ST_DTYPES[p.dtype], "shape": list(p.extents), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for p in pieces.values():
            t = p.local if p.local is not None else torch.zeros(p.extents, dtype=p.dtype)
            t = t.detach().to("cpu", p.dtype).contiguous()  # a copy only for a strided box
            if t.numel():
                data = t.reshape(-1).view(torch.uint8).numpy()
                f.write(data)
                digest.update(data)
            del t
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + pos, digest.hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    """(bytes, sha256) of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def read_header(path: Path) -> dict:
    """The safetensors header (key -> dtype, shape, offsets); ValueError if unreadable."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError("header length is implausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def coverage_gap(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """'' if ``boxes`` (offsets, extents) tile a tensor of ``shape`` exactly once, else
    what is wrong."""
    for off, ext in boxes:
        if len(off) != len(shape) or len(ext) != len(shape):
            return f"a slice at {list(off)} has {len(off)} dimensions, the tensor {len(shape)}"
        if any(o < 0 or e <= 0 or o + e > s for o, e, s in zip(off, ext, shape)):
            return f"the slice at {list(off)} of extent {list(ext)} lies outside the tensor"
    for i, (a_off, a_ext) in enumerate(boxes):
        for b_off, b_ext in boxes[i + 1:]:
            if all(max(x, y) < min(x + e, y + f) for x, e, y, f in zip(a_off, a_ext, b_off, b_ext)):
                return f"the slices at {list(a_off)} and {list(b_off)} overlap"
    covered = sum(math.prod(ext) for _, ext in boxes)
    if covered != math.prod(shape):
        return f"its slices hold {covered} of its {math.prod(shape)} elements"
    return ""


class Tensors(Mapping):
    """A checkpoint's whole tensors by name, each assembled from its slices when looked up."""

    def __init__(self, directory: Path, meta: dict):
        self.directory, self.meta = directory, meta

    def __getitem__(self, key: str) -> torch.Tensor:
        entry = self.meta["tensors"][key]
        out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        piece = Piece(key, tuple(out.shape), (0,) * out.dim(), out, tuple(out.shape), out.dtype)
        with Reader(self.directory, self.meta) as reader:
            reader.fill(piece)
        return out

    def __iter__(self):
        return iter(self.meta["tensors"])

    def __len__(self) -> int:
        return len(self.meta["tensors"])


class Reader(contextlib.ExitStack):
    """Copies stored slices into pieces, opening each file once."""

    def __init__(self, directory: Path, meta: dict):
        super().__init__()
        self.directory, self.meta = Path(directory), meta
        self.handles: dict = {}

    def _handle(self, name: str):
        if name not in self.handles:
            from safetensors import safe_open

            self.handles[name] = self.enter_context(safe_open(str(self.directory / name), framework="pt"))
        return self.handles[name]

    def fill(self, piece: Piece) -> None:
        """Copy into ``piece.local`` every stored element of its box."""
        entry = self.meta["tensors"].get(piece.key)
        if entry is None or tuple(entry["shape"]) != piece.shape:
            what = "lacks" if entry is None else f"has shape {entry['shape']} for"
            raise CheckpointError(f"checkpoint {str(self.directory)!r} {what} tensor {piece.key!r} "
                                  f"(this model: {list(piece.shape)}); resume with the same model settings")
        want, got = (piece.offsets, piece.extents), 0
        for s in entry["slices"]:
            stored = (tuple(s["offsets"]), tuple(s["extents"]))
            common = intersect(want, stored) if piece.offsets else ((), ())
            if common is None:
                continue
            src = self._handle(s["file"]).get_slice(s["key"])[_index_of(common, stored[0])]
            piece.local[_index_of(common, piece.offsets)].copy_(src)
            got += math.prod(common[1])
            del src
        if got != math.prod(piece.extents):
            raise CheckpointError(f"checkpoint {str(self.directory)!r} is incomplete: its slices of "
                                  f"tensor {piece.key!r} do not cover {list(piece.offsets)}+{list(piece.extents)}")


def _index_of(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - g, o - g + e) for o, e, g in zip(box[0], box[1], origin))
