"""Reading a prepared dataset (``paratrain data prepare``): its shards memory-mapped as one
token stream, split into training and validation at the position ``meta.json`` records."""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .prepare import FORMAT, META, DataError


@dataclass(frozen=True)
class DatasetMeta:
    """What ``meta.json`` says about a dataset."""

    path: Path
    vocab_size: int
    eos_id: int
    tokens: int
    train_tokens: int
    tokenizer: str
    raw: dict


def read_meta(path: str | Path) -> DatasetMeta:
    """The dataset's metadata, after checking that every shard is there at its size;
    DataError names what is wrong."""
    root = Path(path)
    file = root / META
    if not file.is_file():
        raise DataError(f"--data {path}: no {META} there; make a dataset with "
                        f"`paratrain data prepare INPUT... --tokenizer T --out {path}`")
    try:
        meta = json.loads(file.read_text())
        if meta.get("format") != FORMAT:
            raise DataError(f"{file}: format {meta.get('format')!r}, this paratrain reads {FORMAT}")
        itemsize = np.dtype(meta["dtype"]).itemsize
        for shard in meta["shards"]:
            size = (root / shard["file"]).stat().st_size if (root / shard["file"]).is_file() else -1
            if size != shard["tokens"] * itemsize:
                raise DataError(f"{root / shard['file']}: expected {shard['tokens'] * itemsize} bytes, "
                                f"found {'none' if size < 0 else size}; prepare the dataset again")
        return DatasetMeta(root, meta["vocab_size"], meta["eos_id"], meta["tokens"],
                           meta["train_tokens"], meta["tokenizer"], meta)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{file}: unreadable metadata ({exc}); prepare the dataset again") from None


def verify(path: str | Path) -> None:
    """Recompute every shard's SHA-256 and compare with the metadata (reads everything)."""
    meta = read_meta(path)
    for shard in meta.raw["shards"]:
        digest = hashlib.sha256()
        with open(meta.path / shard["file"], "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        if digest.hexdigest() != shard["sha256"]:
            raise DataError(f"{meta.path / shard['file']}: checksum mismatch (corrupt shard); "
                            f"prepare the dataset again")


class TokenStream:
    """Shards memory-mapped end to end: ``len`` and slicing, as one array of token ids."""

    def __init__(self, maps: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.maps = maps
        self.offsets = np.cumsum([0] + [len(m) for m in maps]).tolist()
        self.start, self.stop = start, self.offsets[-1] if stop is None else stop

    @classmethod
    def open(cls, meta: DatasetMeta) -> "TokenStream":
        dtype = np.dtype(meta.raw["dtype"])
        maps = [np.memmap(meta.path / s["file"], dtype=dtype, mode="r") for s in meta.raw["shards"]]
        return cls(maps)

    def split(self, cut: int) -> tuple["TokenStream", "TokenStream"]:
        return (TokenStream(self.maps, self.start, self.start + cut),
                TokenStream(self.maps, self.start + cut, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray:
        lo, hi, _ = index.indices(len(self))
        lo, hi = lo + self.start, hi + self.start
        parts = []
        while lo < hi:
            shard = bisect_right(self.offsets, lo) - 1
            end = min(hi, self.offsets[shard + 1])
            parts.append(self.maps[shard][lo - self.offsets[shard]:end - self.offsets[shard]])
            lo = end
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def load_split(path: str | Path) -> tuple[TokenStream, TokenStream, DatasetMeta]:
    """Training and validation token streams of a prepared dataset."""
    meta = read_meta(path)
    train, val = TokenStream.open(meta).split(meta.train_tokens)
    return train, val, meta
