"""``paratrain data prepare``: text in, token shards out.

Reads ``.txt`` (one document per file), ``.jsonl`` (one document per line, its ``field``)
and ``.parquet`` (one document per row of a column) files, tokenizes the documents with a
Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``, a model directory holding
one, or ``bytes`` for byte-level tokens) in parallel worker processes, appends an
end-of-document token to each, and writes memory-mappable shards (uint16 when the
vocabulary fits, else uint32) with a ``meta.json`` that records the tokenizer, the
vocabulary, token counts and a SHA-256 per shard. The last ``val_fraction`` of the token
stream becomes the validation split, as for the bundled corpus.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import DataError
from .partial import claim, die_with_parent, release

META = "meta.json"
FORMAT = 1
SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
SUFFIXES = (".txt", ".jsonl", ".parquet")
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
BYTES_EOS = 0  # NUL never occurs in text, so byte-level data separates documents with it
PIECE_CHARS = 1 << 18
"""A document longer than this many characters is tokenized in pieces: a tokenizer holds
about 200 bytes per input character while it encodes (a 20 MB line took 4.2 GB)."""
BATCH_CHARS = 1 << 20
"""Characters handed to one worker at a time (at most 256 documents or pieces)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """Where the tokens come from: ``bytes`` or the path of a ``tokenizer.json``."""

    source: str
    eos: str | None = None

    def load(self):
        """The tokenizer object (None for bytes), its vocabulary size and its EOS id."""
        if self.source == "bytes":
            return None, 256, BYTES_EOS
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(self.source)
        except Exception as exc:  # tokenizers raises a bare Exception on a damaged file
            raise DataError(f"--tokenizer {self.source}: not a tokenizer.json the tokenizers "
                            f"library can read ({_one_line(exc)}); give a Hugging Face "
                            f"tokenizer.json, a model directory holding one, or 'bytes'") from None
        if self.eos is not None and tok.token_to_id(self.eos) is None:
            # The user's own --eos: "name one with --eos" would repeat what they just did.
            special = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
            raise DataError(f"--eos {self.eos!r}: not a token of {self.source}; its special "
                            f"tokens are {', '.join(special) or 'none'}")
        eos = self.eos or next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(f"{self.source}: no end-of-document token found (tried "
                            f"{', '.join(EOS_CANDIDATES)}); name one with --eos TOKEN")
        return tok, tok.get_vocab_size(with_added_tokens=True), tok.token_to_id(eos)


def resolve_tokenizer(name: str, eos: str | None = None) -> TokenizerSpec:
    """``bytes``, a ``tokenizer.json`` file, or a directory holding one (a local Hugging
    Face model directory); anything else is refused, nothing is downloaded."""
    if name == "bytes":
        if eos is not None:  # NUL always ends a byte-level document: --eos would be ignored
            raise DataError(f"--eos {eos!r}: byte-level data (--tokenizer bytes) ends every "
                            f"document with NUL (id {BYTES_EOS}); leave --eos out, or give a "
                            f"tokenizer.json that has the token")
        return TokenizerSpec("bytes", eos)
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {name!r}: not 'bytes', a tokenizer.json file, or a local "
                        f"model directory containing tokenizer.json (nothing is downloaded)")
    return TokenizerSpec(str(path.resolve()), eos)


def read_documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one input file, by its extension."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        yield path.read_text(encoding="utf-8", errors="replace")
    elif suffix == ".jsonl":
        yield from _json_lines(path, field)
    elif suffix == ".parquet":
        table = _read_parquet(path, field)
        yield from (doc for doc in table.column(field).to_pylist() if doc is not None)
    else:
        raise DataError(_unsupported(path))


def _json_lines(path: Path, field: str) -> Iterator[str]:
    """The ``field`` of each line: text, or null (skipped, as a parquet null is); anything
    else, or a file that is not UTF-8, is named with its line."""
    n = 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)[field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f"{path}:{n}: not a JSON object with a {field!r} field "
                                    f"(--field names the text field)") from None
                if doc is not None and not isinstance(doc, str):
                    raise DataError(f"{path}:{n}: the {field!r} field is {type(doc).__name__}, "
                                    f"not text (--field names the text field)")
                if doc is not None:
                    yield doc
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 ({exc.reason}) near line {n + 1}; JSON lines "
                        f"must be UTF-8 text") from None


def _one_line(exc: Exception) -> str:
    """A library's message on one line (pyarrow's and tokenizers' may span several)."""
    return " ".join(str(exc).split())


def _unsupported(path: Path) -> str:
    return (f"{path}: unsupported input {path.suffix or 'without extension'}; "
            f"give .txt, .jsonl or .parquet files")


def check_inputs(files: list[Path], field: str) -> None:
    """Fail before any work on a missing file, an unsupported extension, or a .jsonl /
    .parquet file whose first record has no ``field`` (the cheap checks: a later record
    without it still fails, during tokenizing)."""
    folders = [p for p in files if p.is_dir()]
    if folders:
        raise DataError(f"{folders[0]} is a directory; give its files, e.g. "
                        f"{folders[0] / '*.txt'} (the shell expands the pattern)")
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DataError(f"input file(s) not found: {', '.join(missing)}")
    bad = [p for p in files if p.suffix.lower() not in SUFFIXES]
    if bad:
        raise DataError("; ".join(_unsupported(p) for p in bad))
    if all(p.stat().st_size == 0 for p in files):  # the dataset would hold no text
        raise DataError(f"{', '.join(map(str, files))}: empty (0 bytes), nothing to tokenize; "
                        f"give files that hold text")
    for path in files:
        if path.suffix.lower() == ".jsonl":
            _check_first_line(path, field)
        elif path.suffix.lower() == ".parquet":
            _parquet(path, field)


def _check_first_line(path: Path, field: str) -> None:
    """The first document of a .jsonl file reads as text (DataError naming the line if not)."""
    next(_json_lines(path, field), None)


def _parquet(path: Path, field: str):
    """pyarrow.parquet, once ``path``'s schema is known to have the column ``field``."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None
    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (--field names the text column)")
    kind = schema.field(field).type
    if str(kind) not in ("string", "large_string", "string_view"):
        raise DataError(f"{path}: column {field!r} holds {kind}, not text (--field names the "
                        f"text column)")
    return pq


def _read_parquet(path: Path, field: str):
    """The ``field`` column of a parquet file; a damaged file (past its footer, which
    ``check_inputs`` read) is named, not a pyarrow traceback."""
    pq = _parquet(path, field)
    try:
        return pq.read_table(path, columns=[field])
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None


def pieces(doc: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """``doc`` in pieces of at most ``limit`` characters, each cut just after a line break,
    else just before a space (a word keeps its leading space), that a non-space follows;
    else anywhere. Byte-level BPE tokenizers (GPT-2's, Llama 3's) pre-tokenize at exactly
    such places, so the pieces' tokens are the whole document's (a SentencePiece
    tokenizer may begin a piece with a word-start mark the whole text had not)."""
    start = 0
    while len(doc) - start > limit:
        window = doc[start:start + limit]
        cut = next((i + 1 for i in _breaks(window, "\n")), 0) or next(
            (i for i in _breaks(window, " ")), 0) or limit
        yield doc[start:start + cut]
        start += cut
    yield doc[start:]


def _breaks(window: str, char: str) -> Iterator[int]:
    """Positions of ``char`` in ``window``, last first, that a non-space follows."""
    at = window.rfind(char)
    while at > 0:
        if at + 1 < len(window) and not window[at + 1].isspace():
            yield at
        at = window.rfind(char, 0, at)


def _encode(args: tuple[TokenizerSpec, list[tuple[str, bool]]]) -> tuple[np.ndarray, int]:
    """Worker: the token ids of a batch of (text, ends a document), with EOS after each
    document's last piece, and how many documents ended."""
    spec, items = args
    tok, _, eos = _loaded(spec)
    texts = [text for text, _ in items]
    if tok is None:
        parts = [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for d in texts]
    else:
        parts = [np.asarray(e.ids, dtype=np.uint32) for e in tok.encode_batch(texts)]
    out = []
    for p, (_, ends) in zip(parts, items):
        out += [p, np.array([eos], dtype=np.uint32)] if ends else [p]
    return (np.concatenate(out) if out else np.zeros(0, dtype=np.uint32)), sum(e for _, e in items)


@functools.lru_cache(maxsize=2)
def _loaded(spec: TokenizerSpec):
    """Each worker process loads the tokenizer once (a pure memo of ``spec.load``)."""
    return spec.load()


def _ordered_map(pool: ProcessPoolExecutor, fn, items: Iterator, ahead: int) -> Iterator:
    """``pool.map`` that reads ``items`` only ``ahead`` tasks in advance (bounded memory)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _batches(files: list[Path], field: str, size: int,
             chars: int = BATCH_CHARS) -> Iterator[list[tuple[str, bool]]]:
    """Batches of (text, ends a document): at most ``size`` items and about ``chars``
    characters each, a long document cut into ``pieces``."""
    batch: list[tuple[str, bool]] = []
    held = 0
    for path in files:
        for doc in read_documents(path, field):
            parts = list(pieces(doc, PIECE_CHARS)) if len(doc) > PIECE_CHARS else [doc]
            for i, text in enumerate(parts):
                batch.append((text, i == len(parts) - 1))
                held += len(text)
                if len(batch) == size or held >= chars:
                    yield batch
                    batch, held = [], 0
    if batch:
        yield batch


class _ShardWriter:
    """Appends token ids to fixed-size shard files, hashing each as it goes."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int):
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._hash = None
        self._count = 0
        self.total = 0

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None:
                name = f"tokens-{len(self.shards):05d}.bin"
                self._file, self._hash, self._count = open(self.out / name, "wb"), hashlib.sha256(), 0
                self.shards.append({"file": name})
            take = ids[:self.shard_tokens - self._count]
            data = take.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(take)
            self.total += len(take)
            ids = ids[len(take):]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._close_shard()

    def discard(self) -> None:
        """Close an open shard without finishing it (the run failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def prepare(inputs: list[str], tokenizer: str, out: str, field: str = "text",
            val_fraction: float = 0.05, workers: int = 0, eos: str | None = None,
            shard_tokens: int = SHARD_TOKENS, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into a dataset directory ``out``; returns its metadata."""
    files = [Path(p) for p in inputs]
    check_inputs(files, field)  # before the tokenizer loads and the worker pool starts
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction}: give a share in [0, 1)")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise DataError(f"--out {out}: a file, not a directory; name a new directory")
    if target.exists() and any(target.iterdir()):
        raise DataError(f"--out {out}: the directory exists and is not empty; choose a new one")
    spec = resolve_tokenizer(tokenizer, eos)
    _, vocab, eos_id = spec.load()  # fails here, before any work, on a bad tokenizer
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    tmp = target.with_name(target.name + ".partial")
    claim(tmp, out)
    writer = _ShardWriter(tmp, dtype, shard_tokens)
    try:
        documents = _tokenize_into(writer, spec, files, field, workers or os.cpu_count() or 1, progress)
        writer.close()
        meta = {"format": FORMAT, "tokenizer": spec.source, "vocab_size": vocab, "eos_id": eos_id,
                "dtype": dtype.name, "documents": documents, "tokens": writer.total,
                "train_tokens": int(writer.total * (1 - val_fraction)), "shards": writer.shards,
                "inputs": [str(p) for p in files]}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        release(tmp)
        if target.exists():
            target.rmdir()
        tmp.rename(target)  # the dataset appears whole, or not at all
    finally:  # after the rename there is no tmp; after any failure, no half-written dataset
        writer.discard()
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _tokenize_into(writer: _ShardWriter, spec: TokenizerSpec, files: list[Path], field: str,
                   workers: int, progress: bool) -> int:
    from tqdm import tqdm

    bar = tqdm(unit="doc", desc="tokenizing", disable=not progress)
    documents, chars = 0, [0]

    def batches() -> Iterator[tuple[TokenizerSpec, list[str]]]:
        for b in _batches(files, field, 256):
            chars[0] += sum(len(text) for text, _ in b)  # counted here: EOS tokens alone are no text
            yield spec, b

    with ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent) as pool:
        for ids, n in _ordered_map(pool, _encode, batches(), ahead=2 * workers):
            writer.write(ids)
            documents += n
            bar.update(n)
            bar.set_postfix(tokens=f"{writer.total:,}")
    bar.close()
    if not chars[0]:  # no dataset of end-of-document tokens alone
        fields = any(p.suffix.lower() != ".txt" for p in files)
        raise DataError(f"the inputs hold no text ({documents} document(s), all empty); give "
                        f"files that hold text{', and --field naming its field' if fields else ''}")
    return documents

