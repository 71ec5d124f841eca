"""Publishing a checkpoint directory atomically and durably.

Files go into a hidden temporary directory beside the checkpoint (``.step-N.tmp``). The
index is written last, to a ``.part`` file renamed into place, so a directory with an
index is complete; the temporary directory is then renamed to ``step-N``, each step
fsynced, so a checkpoint exists whole or not at all, also after a power loss. Re-saving a
step that exists first moves the old one aside (``.step-N.old``); ``recover_replaced``
puts it back if the process died before the new one took its place, and
``remove_unpublished`` clears the temporary directory of a save that died before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def fresh(tmp: Path, directory: Path) -> str:
    """An empty temporary directory ``tmp`` for ``directory``; '' or the error."""
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as exc:
        return os_error(exc, directory)
    return ""


def os_error(exc: OSError, directory: Path) -> str:
    """The message for a failed write of checkpoint ``directory``: what, where, the fix."""
    return (f"could not write checkpoint {str(directory)!r}: {exc.strerror or exc} "
            f"({exc.filename or directory}); nothing was left half-written. Free "
            f"space or choose a writable --run-dir")


SEAL = "index_sha256"
"""The index's own checksum, a field of it: SHA-256 of the rest, as canonical JSON."""


def seal(index: dict) -> dict:
    """``index`` with its checksum: a changed digit (step 20 -> 28) is then found."""
    return {**index, SEAL: index_digest(index)}


def index_digest(index: dict) -> str:
    body = {k: v for k, v in index.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def commit(tmp: Path, directory: Path, index_name: str, index: dict) -> str:
    """Write the index last (atomically), then publish ``tmp`` as ``directory``; '' or
    the error."""
    old = directory.with_name(f".{directory.name}.old")
    try:
        part = tmp / f"{index_name}.part"
        part.write_text(json.dumps(seal(index), indent=1))
        fsync(part)
        os.rename(part, tmp / index_name)  # the checkpoint is complete from here
        fsync(tmp)
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)  # a stale one from a crash after publishing
            directory.rename(old)
        os.rename(tmp, directory)
        fsync(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        if old.exists() and not directory.exists():
            old.rename(directory)
        return os_error(exc, directory)
    return ""


def recover_replaced(folder: Path) -> list[str]:
    """Put back each checkpoint that ``commit`` had moved aside to replace it (re-saving a
    step that exists) when the process died before the new one took its place; notes."""
    notes = []
    for old in Path(folder).glob(".step-*.old"):
        directory = old.with_name(old.name[1:-len(".old")])
        if not directory.exists():
            old.rename(directory)
            notes.append(f"restored {directory.name}: a save replacing it was interrupted")
    return notes


def remove_unpublished(folder: Path) -> list[str]:
    """Remove each temporary directory a save left when its process died before publishing
    (``.step-N.tmp``: never a checkpoint, and as large as one); notes. Call it only while no
    live run may be saving into ``folder``."""
    notes = []
    for tmp in sorted(Path(folder).glob(".step-*.tmp")):
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        shutil.rmtree(tmp, ignore_errors=True)
        notes.append(f"removed {tmp.name} ({size / 2**20:.1f} MiB): a save interrupted before "
                     f"it published")
    return notes


def fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
