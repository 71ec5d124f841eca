"""Reading a prepared dataset (``paratrain data prepare``): its shards memory-mapped as one
token stream, split into training and validation at the position ``meta.json`` records."""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..paths import is_plain_name
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

    @property
    def identity(self) -> str:
        """What the dataset holds, in 16 hex digits: a digest of its shards' SHA-256s, token
        counts and split, from ``meta.json`` alone (no data read). The same path prepared
        again from other text gets another identity."""
        shards = ";".join(f"{s['sha256']}:{s['tokens']}" for s in self.raw["shards"])
        text = f"{shards}|{self.train_tokens}|{self.vocab_size}|{self.eos_id}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_meta(path: str | Path, what: str = "--data") -> DatasetMeta:
    """The dataset's metadata, after checking its fields' types and that every shard is
    there at its size; DataError names what is wrong, and ``path`` as ``what`` (the flag or
    argument the user gave it by)."""
    root = Path(path)
    file = root / META
    if not file.is_file():
        raise DataError(f"{what} {path}: {_not_a_dataset(root)}")
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as exc:  # not JSON, or not UTF-8
        raise DataError(f"{file}: unreadable metadata ({exc}); prepare the dataset again") from None
    _check_fields(meta, file)
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["shards"]:
        size = (root / shard["file"]).stat().st_size if (root / shard["file"]).is_file() else -1
        if size != shard["tokens"] * itemsize:
            raise DataError(f"{root / shard['file']}: expected {shard['tokens'] * itemsize} bytes, "
                            f"found {'none' if size < 0 else size}; prepare the dataset again")
    return DatasetMeta(root, meta["vocab_size"], meta["eos_id"], meta["tokens"],
                       meta["train_tokens"], meta["tokenizer"], meta)


def _not_a_dataset(root: Path) -> str:
    """Why ``root`` is no dataset and the command that makes one. Text given where a
    dataset goes (a .txt file, a folder of them) is the input of ``prepare``, not its
    ``--out``: prepare refuses an existing --out, so naming it there was a dead end."""
    make = "make a dataset with `paratrain data prepare"
    if root.is_file():
        return f"a file, not a dataset directory; {make} {root} --tokenizer T --out DATA`"
    if root.is_dir():
        return (f"no {META} there, so not a dataset; {make} FILE... --tokenizer T --out DATA` "
                f"with the text files as FILE")
    return f"no {META} there; {make} INPUT... --tokenizer T --out {root}`"


COUNTS = ("vocab_size", "eos_id", "tokens", "train_tokens")
"""Fields of meta.json that hold a whole number >= 0."""


def _check_fields(meta: object, file: Path) -> None:
    """Every field read later has the type ``prepare`` writes: a hand-edited or damaged
    meta.json is refused naming the field, not with a traceback where it is used."""
    def wrong(label: str, record: dict, key: str, want: str) -> DataError:
        found = repr(record[key]) if key in record else "missing"
        return DataError(f"{file}: {label} is {found}, expected {want}; prepare the dataset again")

    if not isinstance(meta, dict):
        raise DataError(f"{file}: holds {type(meta).__name__}, not a JSON object; prepare the "
                        f"dataset again")
    if meta.get("format") != FORMAT:
        raise DataError(f"{file}: format {meta.get('format')!r}, this paratrain reads {FORMAT}")
    for field in COUNTS:
        if not _is_count(meta.get(field)):
            raise wrong(field, meta, field, "a whole number >= 0")
    if not isinstance(meta.get("tokenizer"), str):
        raise wrong("tokenizer", meta, "tokenizer", "a path or 'bytes'")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise wrong("dtype", meta, "dtype", "'uint16' or 'uint32'")
    if not isinstance(meta.get("shards"), list) or not all(isinstance(x, dict) for x in meta["shards"]):
        raise wrong("shards", meta, "shards", "a list of objects")
    for i, shard in enumerate(meta["shards"]):
        for field, ok, want in (("file", is_plain_name(shard.get("file")), "a file name beside meta.json"),
                                ("tokens", _is_count(shard.get("tokens")), "a whole number >= 0"),
                                ("sha256", isinstance(shard.get("sha256"), str), "a hex digest")):
            if not ok:
                raise wrong(f"shards[{i}].{field}", shard, field, want)
    total = sum(x["tokens"] for x in meta["shards"])
    if total != meta["tokens"] or meta["train_tokens"] > total:
        raise DataError(f"{file}: tokens {meta['tokens']} and train_tokens {meta['train_tokens']} "
                        f"do not fit the shards' {total} tokens; prepare the dataset again")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify(path: str | Path, what: str = "--data") -> None:
    """Recompute every shard's SHA-256 and compare with the metadata (reads everything)."""
    meta = read_meta(path, what)
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

    def where(self, position: int) -> str:
        """The shard file and offset of token ``position`` of this stream."""
        at = position + self.start
        shard = bisect_right(self.offsets, at) - 1
        return f"{Path(self.maps[shard].filename).name} at token {at - self.offsets[shard]:,}"


def load_split(path: str | Path) -> tuple[TokenStream, TokenStream, DatasetMeta]:
    """Training and validation token streams of a prepared dataset."""
    meta = read_meta(path)
    train, val = TokenStream.open(meta).split(meta.train_tokens)
    return train, val, meta
