"""Gradient compression for data-parallel reduction, one bucket at a time.

A ``Compressor`` owns one gradient bucket's compression state and averages that bucket
over a group: ``reduce(bucket, group)`` launches the first collective at once (so it
overlaps the rest of backward, as the plain all-reduce does) and returns a handle whose
``wait()`` finishes the job, running a second collective where the method needs one,
and leaves the average in ``bucket``.

=========  ===================================================  ===========  =========
method     what each rank sends                                 collectives  residual
=========  ===================================================  ===========  =========
none       the bucket (all-reduce, average)                     1            -
fp16/bf16  the bucket cast to 16 bits (all-reduce, sum of x/p)  1            -
int8       int8 chunks + one fp32 scale per block of 256        2            yes
topk:F     each tensor's largest F of entries: values + indices 1            yes
powersgd:R P = M Q and Q = M^T P of each matrix, rank R         2            yes
=========  ===================================================  ===========  =========

Error feedback (int8, topk, powersgd; ``:noef`` turns it off): each rank keeps the part of
its gradient that was not sent (the residual) and adds it to the next step's gradient,
so nothing is lost, only delayed. The invariant, over any number of steps:
sum over ranks of (gradients + residual at start) = group size x average + residual now.

int8 (``int8.py``) cannot overflow: no reduction runs on int8 values; see there.

PowerSGD (Vogels et al. 2019): per parameter matrix M (the gradient plus residual, viewed
as rows x columns, transposed so rows <= columns), P = M Q with the previous step's Q
(warm start), all-reduce P, orthogonalize it, Q = M^T P, all-reduce Q; the average is
P Q^T / p and the local residual is M - P (M^T P)^T. Vectors and matrices that rank R
would not shrink by ``min_compression`` (biases, norms) are all-reduced uncompressed,
in the first collective.

Byte counts assume ring algorithms: an all-reduce of n bytes sends 2(p-1)/p n per rank,
an all-gather (p-1) n, an all-to-all (p-1)/p n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch.distributed import ProcessGroup

from . import collectives as C

Method = Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"]
METHODS = ("none", "fp16", "bf16", "int8", "topk", "powersgd")
LOSSY = ("int8", "topk", "powersgd")
FORMS = ("none, fp16, bf16, int8, topk:FRACTION, powersgd:RANK (append :update to int8/topk/powersgd "
         "to average AdamW's updates instead of the gradients, :noef to drop error feedback)")


class CompressError(ValueError):
    """A compression setting that cannot run; the message says what to write instead."""


@dataclass(frozen=True)
class CompressSpec:
    """A parsed ``--compress`` value."""

    method: Method = "none"
    """Which compression."""
    fraction: float = 1.0
    """top-k: share of a bucket's entries sent."""
    rank: int = 0
    """PowerSGD: rank of the approximation."""
    error_feedback: bool = True
    """Keep what was not sent and add it to the next gradient (int8, topk, powersgd)."""
    update: bool = False
    """Average each rank's AdamW update instead of its gradient (``:update``; int8, topk,
    powersgd): every rank steps AdamW on its own gradient first, so error feedback keeps
    the sum of the updates, which AdamW's normalisation would otherwise undo
    (parallel/local_update.py)."""
    start: int = 0
    """Reductions of each bucket (one per optimizer step) averaged uncompressed before
    compression starts, as torch's ``start_powerSGD_iter``: early training is the most
    sensitive to a compressed gradient."""
    undoable: bool = False
    """Keep the state each reduction starts from, so that a step skipped as non-finite
    (``on_nonfinite = "skip"``) leaves no trace: one copy of the residual per step."""
    place: str = ""
    """This rank's place in the layout (``parallelize``: its coordinate and size along
    each axis), which names its state in checkpoints, so that state is restored only to
    the rank holding the same shard of parameters and data; '' names it by global rank."""

    @property
    def text(self) -> str:
        arg = {"topk": f":{self.fraction:g}", "powersgd": f":{self.rank}"}.get(self.method, "")
        lossy = self.method in LOSSY
        return (self.method + arg + (":update" if self.update else "")
                + (":noef" if lossy and not self.error_feedback else ""))


def parse(text: "str | CompressSpec") -> CompressSpec:
    """``'powersgd:4'`` -> CompressSpec (a spec is returned as it is); raises CompressError
    naming the field and the forms."""
    if isinstance(text, CompressSpec):
        return text
    parts = str(text).strip().lower().split(":")
    method, args = parts[0], parts[1:]
    bad = CompressError(f"compress={text!r} is not understood; write one of {FORMS}")
    if method not in METHODS:
        raise bad
    flags = set()
    while args and args[-1] in ("noef", "update") and args[-1] not in flags:
        flags.add(args.pop())
    if flags and method not in LOSSY:
        raise CompressError(f"compress={text!r}: only int8, topk and powersgd keep a residual "
                            f"(:noef) or average AdamW's updates (:update)")
    ef, update = "noef" not in flags, "update" in flags
    if method in ("topk", "powersgd") and len(args) != 1 or method not in ("topk", "powersgd") and args:
        raise bad
    if method == "topk":
        try:
            fraction = float(args[0])
        except ValueError:
            raise bad from None
        if not 0 < fraction <= 1:
            raise CompressError(f"compress={text!r}: the top-k fraction must be in (0, 1], e.g. topk:0.01")
        return CompressSpec("topk", fraction=fraction, error_feedback=ef, update=update)
    if method == "powersgd":
        if not args[0].isdigit() or int(args[0]) < 1:
            raise CompressError(f"compress={text!r}: the PowerSGD rank must be a positive integer, e.g. powersgd:4")
        return CompressSpec("powersgd", rank=int(args[0]), error_feedback=ef, update=update)
    return CompressSpec(method, error_feedback=ef, update=update)  # type: ignore[arg-type]


def check(text: "str | CompressSpec", zero: int, tp: int = 1, replicas: int = 2,
          cp: int = 1) -> CompressSpec:
    """Parse ``text`` and refuse layouts it cannot compose with (``replicas``: the size of
    the data-parallel group whose gradient reduction it compresses, dp x cp)."""
    from .int8 import INT8_BLOCK  # int8.py builds on this module

    spec = parse(text)
    if spec.method != "none" and replicas == 1:
        # Nothing is sent, yet a lossy method would still round or drop the gradient.
        raise CompressError(f"compress={spec.text!r} with dp x cp = 1: there is no data-parallel "
                            f"gradient reduction to compress; leave --compress out, or train with dp > 1")
    if spec.method == "int8" and tp > 1:
        # A block's scale spans neighbouring parameters, sharded ones among them, so the
        # copies of a replicated parameter (a norm weight) on the tp ranks would round
        # differently and drift apart; the other methods are elementwise or per tensor.
        raise CompressError(f"compress={spec.text!r} with tp={tp}: int8 shares one scale per "
                            f"block of {INT8_BLOCK} entries across neighbouring parameters, so the "
                            f"tensor-parallel ranks' copies of a replicated parameter would "
                            f"round differently and drift apart; use fp16, bf16, topk or "
                            f"powersgd with tensor parallelism")
    if spec.update and (zero or cp > 1):
        # AdamW runs on each rank's own gradient: it needs the whole optimizer state on
        # every rank (not ZeRO's shard) and a gradient of whole sequences (a context-
        # parallel rank holds a part of each sequence's gradient, not an estimate of it).
        raise CompressError(f"compress={spec.text!r} with zero={zero}, cp={cp}: ':update' steps "
                            f"AdamW on every rank's own gradient, which needs --zero 0 and --cp 1; "
                            f"drop ':update' to compress the gradients instead")
    if spec.method != "none" and zero >= 2:
        raise CompressError(f"compress={spec.text!r} with zero={zero}: ZeRO-2/3 reduce-scatter every "
                            f"microbatch's gradient into shards and keep no full gradient to "
                            f"compress or to hold a residual for; use --zero 1 (or 0) with --compress")
    return spec


# ---- bytes on the wire (ring algorithms), per rank ------------------------------------------
def all_reduce_bytes(nbytes: int, p: int) -> int:
    return 2 * (p - 1) * nbytes // p


def all_gather_bytes(nbytes_per_rank: int, p: int) -> int:
    return (p - 1) * nbytes_per_rank


def all_to_all_bytes(nbytes: int, p: int) -> int:
    return (p - 1) * nbytes // p


class Pending:
    """A reduction in flight: its collective, then ``finish``, which may launch the next
    collective and return its Pending (PowerSGD's Q, int8's all-gather)."""

    def __init__(self, work, finish: Callable[[], "Pending | None"] | None = None):
        self.work, self.finish = work, finish

    def advance(self) -> None:
        """Wait for the current collective and run what follows it, which may launch the
        next one without waiting for it: advancing every bucket before waiting on any lets
        their second collectives overlap."""
        if self.work is not None:
            self.work.wait()
            nxt = self.finish() if self.finish is not None else None
            self.work, self.finish = (nxt.work, nxt.finish) if isinstance(nxt, Pending) else (None, None)

    def wait(self) -> bool:
        while self.work is not None:
            self.advance()
        return True

    def is_completed(self) -> bool:
        return self.work is None


# ---- the interface and the simple methods ---------------------------------------------------
class Compressor:
    """One bucket's compressed average and its state (residual, PowerSGD's Q)."""

    COUNTERS = ("reductions", "start")
    """State entries that are counters, optional when loading (older checkpoints)."""

    def __init__(self, numel: int, error_feedback: bool = False, device: torch.device | None = None):
        self.numel, self.device = numel, device or torch.device("cpu")
        self.residual = torch.zeros(numel, device=self.device) if error_feedback else None
        self.sent_bytes = 0
        """Bytes this rank has sent for this bucket since the counter was last reset."""
        self.dense_bytes = 0
        """Bytes an uncompressed all-reduce of the same buckets would have sent."""
        self.start = 0
        """Reductions averaged uncompressed before compression starts (CompressSpec.start)."""
        self.reductions = 0
        """Reductions so far (kept in checkpoints with ``start``)."""
        self.undoable = False
        """Keep the state each reduction starts from (``CompressSpec.undoable``)."""
        self._before: list[torch.Tensor] | None = None

    def reduce(self, bucket: torch.Tensor, group: ProcessGroup) -> Pending:
        """Launch the average of ``bucket`` over ``group``; it is in ``bucket`` after wait()."""
        if self.undoable:
            self._keep_state()
        nbytes = all_reduce_bytes(bucket.numel() * bucket.element_size(), C.size(group))
        self.dense_bytes += nbytes
        self.reductions += 1
        if self.reductions <= self.start:  # not yet: the plain average, no residual
            self._sent(nbytes)
            return _plain_average(bucket, group)
        return self._reduce(bucket, group)

    def _reduce(self, bucket: torch.Tensor, group: ProcessGroup) -> Pending:
        raise NotImplementedError

    def _with_residual(self, bucket: torch.Tensor) -> torch.Tensor:
        """The bucket in fp32 plus what earlier steps did not send, in the bucket itself when
        it is fp32: its average overwrites it anyway, and on CPU a fresh bucket-sized tensor
        costs more than the arithmetic (page faults on first touch)."""
        x = bucket.detach() if bucket.dtype == torch.float32 else bucket.detach().float()
        if self.residual is not None:
            x += self.residual
        return x

    @staticmethod
    def _write_back(bucket: torch.Tensor, x: torch.Tensor) -> None:
        """Put the average, computed in ``_with_residual``'s ``x``, into ``bucket``."""
        if x.dtype != bucket.dtype:  # a bucket of another dtype got an fp32 working copy
            bucket.copy_(x)

    def _sent(self, nbytes: int) -> None:
        self.sent_bytes += nbytes

    def _state_tensors(self) -> list[torch.Tensor]:
        return [v for k, v in self.state_dict().items() if k not in self.COUNTERS]

    def _keep_state(self) -> None:
        """Copy the state this reduction starts from (into buffers kept between steps)."""
        if self._before is None:
            self._before = [torch.empty_like(t) for t in self._state_tensors()]
        for kept, live in zip(self._before, self._state_tensors()):
            kept.copy_(live)

    def undo(self) -> None:
        """Forget the last reduction: its step was skipped as non-finite. With ``undoable``
        the state it started from comes back, so the skipped gradient is neither applied
        nor kept in the residual for later steps; without, only its NaN and inf go."""
        if self._before is not None:
            for kept, live in zip(self._before, self._state_tensors()):
                live.copy_(kept)
            self.reductions -= 1
        self.drop_nonfinite()

    def drop_nonfinite(self) -> None:
        """Zero what of the residual is NaN or inf, or every later step would inherit it
        and be skipped too."""
        if self.residual is not None:
            self.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that a checkpoint must keep for the run to resume exactly: the residual,
        and the counters that say whether compression has started (``COUNTERS``)."""
        state = {"residual": self.residual} if self.residual is not None else {}
        return {**state, "reductions": torch.tensor(self.reductions), "start": torch.tensor(self.start)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Install a saved state. Once compression has started it stays started: a resumed
        run keeps the checkpoint's start even where its own differs (the default start is
        10% of ``steps``, so extending a run moves it), or the restored residual would wait
        through uncompressed reductions and arrive late."""
        for name, value in state.items():
            if name not in self.COUNTERS:
                getattr(self, name).copy_(value)
        self.reductions = int(state.get("reductions", self.reductions))
        saved_start = int(state.get("start", self.start))
        if self.reductions > saved_start:
            self.start = saved_start


class NoCompression(Compressor):
    """The plain average: one all-reduce of the bucket as it is."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # nothing to resume

    def _reduce(self, bucket, group):
        self._sent(all_reduce_bytes(bucket.numel() * bucket.element_size(), C.size(group)))
        return _plain_average(bucket, group)


def _plain_average(bucket: torch.Tensor, group: ProcessGroup) -> Pending:
    return Pending(C.all_reduce(bucket, group, op="avg", async_op=True))


class Cast(Compressor):
    """Sum of bucket/p cast to fp16 or bf16 (exact where the values are representable)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | None = None):
        super().__init__(numel, device=device)
        self.dtype = dtype

    def _reduce(self, bucket, group):
        p = C.size(group)
        low = bucket.detach().div(p).to(self.dtype)  # divide first: the sum cannot overflow more than a gradient
        self._sent(all_reduce_bytes(low.numel() * low.element_size(), p))
        work = C.all_reduce(low, group, op="sum", async_op=True)
        return Pending(work, lambda: bucket.copy_(low))


def make_compressor(spec: CompressSpec, views: list[tuple[int, torch.Size]], numel: int,
                    seed: int = 0, device: torch.device | None = None) -> Compressor:
    """The compressor for one bucket of ``numel`` entries holding parameters at
    (offset, shape) ``views`` (PowerSGD compresses each matrix on its own)."""
    compressor = _make(spec, views, numel, seed, device)
    compressor.start = spec.start if spec.method != "none" else 0
    # Averaging AdamW's updates, the reduction runs after the step's non-finite check:
    # a skipped step has reduced nothing, so there is nothing to keep for an undo.
    compressor.undoable = spec.undoable and spec.method != "none" and not spec.update
    return compressor


def _make(spec: CompressSpec, views: list[tuple[int, torch.Size]], numel: int,
          seed: int, device: torch.device | None) -> Compressor:
    if spec.method == "none":
        return NoCompression(numel, device=device)
    if spec.method in ("fp16", "bf16"):
        return Cast(numel, torch.float16 if spec.method == "fp16" else torch.bfloat16, device)
    if spec.method == "int8":
        from .int8 import Int8

        return Int8(numel, spec.error_feedback, device)
    if spec.method == "topk":
        from .topk import TopK

        return TopK(numel, spec.fraction, spec.error_feedback, views, device)
    from .powersgd import PowerSGD

    return PowerSGD(numel, views, spec.rank, spec.error_feedback, seed=seed, device=device)
