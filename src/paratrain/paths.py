"""File names read from an index (a checkpoint's meta.json, a Hugging Face
model.safetensors.index.json, a dataset's meta.json) are input: only a plain name may be
joined to the index's directory, or a crafted index would read, or delete, files elsewhere."""

from __future__ import annotations


def is_plain_name(name: object) -> bool:
    """A file name with no directory part: it can only name a file beside its index."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(c in name for c in ("/", "\\", "\0")))
