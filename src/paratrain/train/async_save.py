"""Checkpoints written while training goes on (``--async-save``; docs/checkpoints.md).

A save has a part that must stop the step and a part that need not:

1. **Stage** (on the training thread, every rank): copy the slices this rank owns
   (``slices.engine_pieces``) into host memory (pinned on a GPU). The next optimizer step
   may then change the live tensors; the copies are the checkpoint.
2. **Write** (a background thread per rank): the rank's file into the hidden temporary
   directory, fsynced and hashed, exactly as the synchronous path writes it; then a small
   record of it (or of its error) next to it, by an atomic rename.
3. **Publish** (rank 0's background thread): once every rank's record is there and none
   failed, the index is written last and the directory renamed into place
   (``publish.commit``), as the synchronous path does. A rank that dies before its record
   leaves the directory unpublished: a checkpoint exists whole or not at all.

Host memory is bounded: at most one save is in flight, and the next one first waits for
it (the wait is logged). Its host buffers are kept for the next save, which stages the same
pieces: copying into memory already touched costs a fraction of fresh pages' faults (one
copy of the rank's own slices stays allocated between saves, as DCP's caching stager does). The outcome (published, or the first error) is agreed on every
rank at that wait or at the end of the run, on the training thread, which is the only one
that uses the process groups: the background threads coordinate through the files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from .. import console
from . import publish as P
from . import slices as S
from .shardio import CheckpointError

log = console.get(__name__)
RECORD = ".record-{rank:05d}.json"
"""Each rank's record of its written file in the temporary directory (removed before
the directory is published)."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One save in flight, as the background thread needs it."""

    tmp: Path
    """The hidden temporary directory the files go into."""
    directory: Path
    """Where the checkpoint is published."""
    pieces: list
    """This rank's staged slices (``slices.Piece`` with host copies)."""
    meta: dict
    """The index's metadata (step, model, layout, run): rank 0's part of the index."""


class AsyncSaver:
    """At most one checkpoint in flight for this rank (see the module doc)."""

    def __init__(self, rank: int, world: int, timeout_s: float, pin: bool = False):
        self.rank, self.world, self.timeout_s, self.pin = rank, world, timeout_s, pin
        self._thread: threading.Thread | None = None
        self._job: Job | None = None
        self._outcome = ""  # rank 0: '' once published, else why not
        self._buffers: dict[int, torch.Tensor] = {}  # host copies, reused by the next save
        self.staged_bytes = 0
        """Bytes of host memory the save in flight holds (its staged copies)."""

    # ---- the training thread -----------------------------------------------------------------
    def submit(self, directory: Path, engine, meta: dict, agree) -> Path | None:
        """Stage this rank's slices and start writing them (collective: every rank calls
        it at the same step); returns the previous save's directory, published meanwhile.
        ``agree(error)`` turns rank 0's verdict into every rank's."""
        published = self.wait(agree)
        tmp = directory.with_name(f".{directory.name}.tmp")
        agree(P.fresh(tmp, directory) if self.rank == 0 else "")
        pieces = [self._stage(p, i) for i, p in enumerate(S.engine_pieces(engine, for_save=True))]
        self.staged_bytes = sum(p.local.untyped_storage().nbytes() for p in pieces if p.local is not None)
        self._job = Job(tmp, directory, pieces, meta)
        self._thread = threading.Thread(target=self._write, args=(self._job,), daemon=True,
                                        name=f"paratrain-save-{directory.name}")
        self._thread.start()
        return published

    def wait(self, agree) -> Path | None:
        """Wait for the save in flight and agree on its outcome (collective); raises
        CheckpointError on every rank if it failed. Returns the published directory."""
        if self._thread is None:
            return None
        start = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - start
        if self.rank == 0 and waited > 0.05:
            log.info(f"checkpoint    waited {waited:.2f} s for {self._job.directory.name} to be written")
        job, self._thread, self._job, self.staged_bytes = self._job, None, None, 0
        outcome, self._outcome = self._outcome, ""
        agree(outcome if self.rank == 0 else "")
        return job.directory

    def _stage(self, piece: S.Piece, index: int) -> S.Piece:
        """``piece`` with a host copy of its data, in the buffer the same piece of the
        previous save used: a run's saves stage the same pieces, and writing into memory
        already touched costs a fraction of fresh pages' faults."""
        if piece.local is None:
            return piece
        local = piece.local.detach()
        copy = self._buffers.get(index)
        if copy is None or copy.shape != local.shape or copy.dtype != local.dtype:
            copy = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin and local.is_cuda)
            self._buffers[index] = copy
        copy.copy_(local, non_blocking=copy.is_pinned())
        if copy.is_pinned():
            torch.cuda.current_stream(local.device).synchronize()
        return dataclasses.replace(piece, local=copy)

    # ---- the background thread ---------------------------------------------------------------
    def _write(self, job: Job) -> None:
        from .checkpoint import INDEX, _index, _write_file

        error, record = "", None
        try:
            if job.pieces:
                record = _write_file(job.tmp, f"rank-{self.rank:05d}.safetensors", job.pieces, job.directory)
        except CheckpointError as exc:
            error = f"{exc} (on rank {self.rank})"
        except Exception as exc:  # noqa: BLE001  reported at the next wait, on every rank
            error = f"{type(exc).__name__}: {exc} (on rank {self.rank})"
        job.pieces.clear()  # written: the host buffers wait for the next save (AsyncSaver._buffers)
        _publish_record(job.tmp, self.rank, {"error": error, "record": record})
        if self.rank != 0:
            return
        try:
            records, self._outcome = self._gather(job)
            if not self._outcome:
                self._outcome = P.commit(job.tmp, job.directory, INDEX, _index(job.meta, records))
        except Exception as exc:  # noqa: BLE001  never reported as published
            self._outcome = f"checkpoint {str(job.directory)!r} not published: {type(exc).__name__}: {exc}"
        if self._outcome:
            shutil.rmtree(job.tmp, ignore_errors=True)

    def _gather(self, job: Job) -> tuple[list[dict], str]:
        """Rank 0: every rank's record (waiting for them), and the first error."""
        deadline = time.monotonic() + self.timeout_s
        paths = [job.tmp / RECORD.format(rank=r) for r in range(self.world)]
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                return [], (f"checkpoint {str(job.directory)!r} not published: ranks {missing} did "
                            f"not finish writing within {self.timeout_s:g} s (--timeout-s)")
            time.sleep(0.02)
        found = [json.loads(p.read_text()) for p in paths if p.exists()]
        for p in paths:
            p.unlink(missing_ok=True)
        error = next((f["error"] for f in found if f["error"]), "")
        return [f["record"] for f in found if f["record"]], error


def _publish_record(tmp: Path, rank: int, content: dict) -> None:
    """Write ``content`` where rank 0 looks for it, atomically (rename after write)."""
    path = tmp / RECORD.format(rank=rank)
    part = path.with_name(path.name + ".part")
    try:
        part.write_text(json.dumps(content))
        os.replace(part, path)
    except OSError:  # the directory went away (a failed save removed it): nothing to report to
        pass
