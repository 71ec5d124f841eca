"""Sharded initialisation: a model built without storage, given only each rank's share.

``train`` builds the model on the meta device (shapes, no storage) and parallelizes it as
it is: tensor parallelism cuts meta weights, the pipeline keeps this rank's stages, ZeRO-3
lays out flat units without allocating them. Then each rank allocates what it holds and
fills every piece of it (a box of one plain-model tensor: ``train/slices.py``, the same
pieces sharded checkpoints read and write) from a *source*:

* ``SeededInit``: the model's own initialiser, one tensor at a time from a generator
  seeded by (run seed, tensor name), so the values do not depend on the layout and equal
  a single process's with the same seed;
* ``models.hf.SafetensorsSlices``: a Hugging Face directory, read slice by slice;
* a checkpoint's ``Reader`` (``train/checkpoint.load_into``).

No rank ever holds the whole model. A source produces at most one whole tensor at a
time (the initialiser draws a tensor whole, keeps the rank's boxes and drops it), so the
largest tensor bounds a rank's extra memory while it initialises.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch
from torch import nn

from . import slices as S


class Source(Protocol):
    """Where initial values come from: a context manager whose ``fill`` copies one piece."""

    def __enter__(self) -> "Source": ...

    def __exit__(self, *exc) -> None: ...

    def fill(self, piece: S.Piece) -> None:
        """Copy the values of ``piece``'s box of tensor ``piece.key`` into ``piece.local``."""


class SeededInit(contextlib.AbstractContextManager):
    """Values from ``init(name, shape, device)``, a whole tensor at a time; the last one
    drawn is kept while pieces of the same tensor follow (they come in order)."""

    def __init__(self, init: Callable[[str, tuple[int, ...], torch.device], torch.Tensor]):
        self.init = init
        self._name, self._value = "", None

    def __exit__(self, *exc) -> None:
        self._name, self._value = "", None

    def fill(self, piece: S.Piece) -> None:
        name = piece.key.removeprefix("param/")
        if name != self._name:
            self._value = None  # drop the previous tensor before drawing the next
            self._value = self.init(name, piece.shape, piece.local.device)
            self._name = name
        box = tuple(slice(o, o + e) for o, e in zip(piece.offsets, piece.extents))
        piece.local.copy_(self._value[box])


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` lacks storage (built on the meta device)."""
    return any(p.is_meta for p in module.parameters())


@torch.no_grad()
@torch.no_grad()
def fill(engine, source: Source) -> None:
    """Fill every parameter piece this rank holds from ``source``; every rank calls it."""
    with source:
        for piece in S.engine_pieces(engine, for_save=False):
            if piece.key.startswith("param/") and piece.local is not None:
                source.fill(piece)
    S.after_load(engine)


def initial_source(cfg) -> Source:
    """A run's initial weights: its Hugging Face directory's, else the seeded initialiser
    (``models.gpt.init_tensor`` with ``train.seed``)."""
    from ..models import hf
    from ..models.gpt import init_tensor

    if hf.is_model_dir(cfg.model_preset):
        return hf.SafetensorsSlices(cfg.model_preset, cfg.model)
    return SeededInit(lambda name, shape, device: init_tensor(cfg.model, name, shape,
                                                             cfg.train.seed, device))
