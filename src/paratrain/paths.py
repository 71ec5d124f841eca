"""Files, safely: names read from an index (a checkpoint's meta.json, a Hugging Face
model.safetensors.index.json, a dataset's meta.json) are input, and only a plain name may be
joined to the index's directory, or a crafted index would read, or delete, files elsewhere;
small records are replaced whole (``write_atomic``)."""

from __future__ import annotations

from pathlib import Path


def is_plain_name(name: object) -> bool:
    """A file name with no directory part: it can only name a file beside its index."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in ("/", "\\", "\0")))


def write_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text`` at once: written beside it as ``.NAME.tmp``, then
    renamed, so a reader (or a run killed mid-write) sees the old file or the new one, never
    half of one. On failure (a full disk) the temporary file is removed and the error
    raised."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
