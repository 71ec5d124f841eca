"""Tokens and who reads which: the bundled corpus, byte-level tokens, a distributed sampler.

Every rank computes the same *global* batch of sample indices for a step from the seed
alone, then takes its own contiguous slice; no data moves between ranks, and the token
count of the whole global batch (needed to normalise the loss) is known everywhere.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .. import rules
from ..data.dataset import TokenStream, load_split
from ..errors import RunError
from ..models.gpt import IGNORE_INDEX

PAD = -1  # sample index of a padding row: its targets are all masked


def load_corpus(path: str = "") -> torch.Tensor:
    """The bytes of ``path`` (or of the bundled corpus) as a uint8 tensor of token ids."""
    if path:
        raw = Path(path).read_bytes()
    else:
        raw = gzip.decompress(resources.files("paratrain.data").joinpath("corpus.txt.gz").read_bytes())
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def load_tokens(data) -> tuple[torch.Tensor | TokenStream, torch.Tensor | TokenStream]:
    """Training and validation tokens of a run (``DataConfig``): a prepared dataset's
    splits (``data.data``), else the corpus bytes split at ``val_fraction``."""
    if data.data:
        train, val, _ = load_split(data.data)
        return train, val
    return split(load_corpus(data.corpus), data.val_fraction)


def split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the start of the corpus, validate on its last ``val_fraction``."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


@dataclass
class Samples:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs and shifted targets)."""

    tokens: torch.Tensor | TokenStream
    """The token stream: bytes of a corpus (uint8), or a prepared dataset's memory-mapped
    shards (``data/dataset.py``)."""
    seq_len: int
    """Tokens per sample."""
    vocab_size: int = 0
    """The model's vocabulary: a token id at or past it (a damaged shard) is named where it
    was read, instead of failing as an IndexError deep in the embedding (0: not checked)."""
    source: str = ""
    """What the tokens are, for that message (the dataset's directory)."""

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def batch(self, indices: list[int], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, (len(indices), seq_len) int64; PAD rows have masked targets."""
        rows, targets = [], []
        for i in indices:
            if i == PAD:
                rows.append(torch.zeros(self.seq_len + 1, dtype=torch.long))
            else:
                rows.append(torch.as_tensor(np.asarray(
                    self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64)))
        window = torch.stack(rows)
        if self.vocab_size and int(window.max()) >= self.vocab_size:
            raise self._out_of_vocabulary(window, indices)
        targets = window[:, 1:].clone()
        targets[torch.tensor(indices) == PAD] = IGNORE_INDEX
        return window[:, :-1].to(device), targets.to(device)

    def _out_of_vocabulary(self, window: torch.Tensor, indices: list[int]) -> "TokenIdError":
        row, col = (int(x) for x in (window >= self.vocab_size).nonzero()[0])
        position = indices[row] * self.seq_len + col
        where = (self.tokens.where(position) if isinstance(self.tokens, TokenStream)
                 else f"token {position:,}")
        return TokenIdError(f"{self.source or 'the corpus'}: {where} holds token id "
                            f"{int(window[row, col])}, beyond the model's vocabulary of "
                            f"{self.vocab_size}: the data is damaged (`paratrain data verify "
                            f"{self.source}` checks every shard) or was prepared with another tokenizer")


class TokenIdError(RunError):
    """A token id the model's vocabulary does not have: damaged data."""


@dataclass
class DistributedSampler:
    """Which samples each data-parallel rank reads at each step.

    Epoch e visits the samples in a pseudo-random order (``shuffled``: a bijection keyed
    by seed and epoch, computed per index, so a step costs the same at 10 thousand samples
    or 10 billion) in global batches. A remainder smaller than a global batch is dropped
    (``remainder="drop"``) or filled with PAD rows whose targets are masked (``"pad"``),
    so every sample is read exactly once per epoch. The step alone fixes the batch: it is
    the data position a checkpoint needs.
    """

    num_samples: int
    """Samples in the data set."""
    global_batch: int
    """Samples per step over all data-parallel ranks."""
    dp_rank: int
    """This rank's position on the data-parallel axis."""
    dp_size: int
    """Data-parallel ranks."""
    seed: int = 0
    """Seed of the shuffle (combined with the epoch)."""
    remainder: str = "drop"
    """drop or pad."""

    def __post_init__(self) -> None:
        rules.batch(self.global_batch, self.dp_size)  # a LayoutError (ValueError) naming the fix
        if self.steps_per_epoch == 0:
            raise ValueError(f"the data has {self.num_samples} samples, fewer than one global batch "
                             f"of {self.global_batch}; use a larger corpus or a smaller batch")

    @property
    def steps_per_epoch(self) -> int:
        if self.remainder == "pad":
            return math.ceil(self.num_samples / self.global_batch)
        return self.num_samples // self.global_batch

    @property
    def dropped_per_epoch(self) -> int:
        return 0 if self.remainder == "pad" else self.num_samples % self.global_batch

    def global_indices(self, step: int) -> list[int]:
        """The sample indices of the whole global batch at ``step`` (PAD for padding)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        end = min((k + 1) * self.global_batch, self.num_samples)
        chosen = shuffled(range(k * self.global_batch, end), self.num_samples, self.seed, epoch)
        return chosen + [PAD] * (self.global_batch - len(chosen))

    def local_indices(self, step: int) -> list[int]:
        """This rank's contiguous share of the global batch at ``step``."""
        share = self.global_batch // self.dp_size
        return self.global_indices(step)[self.dp_rank * share:(self.dp_rank + 1) * share]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic): well-spread hashes."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shuffled(positions: range | list[int], n: int, seed: int, epoch: int) -> list[int]:
    """The samples at ``positions`` of epoch ``epoch``'s order of ``n`` samples: a 4-round
    Feistel network over the smallest even power of two >= n, keyed by (seed, epoch), with
    cycle-walking back into [0, n). A bijection of [0, n), O(1) work per position."""
    half = np.uint64(max(1, ((max(n - 1, 1)).bit_length() + 1) // 2))
    mask = (np.uint64(1) << half) - np.uint64(1)
    key = _mix(_mix(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))[0]
    x = np.asarray(positions, dtype=np.uint64)
    todo = np.ones(len(x), dtype=bool)
    while todo.any():  # cycle-walk: values outside [0, n) go round again (< 2 rounds expected)
        left, right = x[todo] >> half, x[todo] & mask
        for r in range(4):
            left, right = right, left ^ (_mix(right ^ key ^ np.uint64(r << 56)) & mask)
        x[todo] = (left << half) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64).tolist()


def valid_tokens(indices: list[int], seq_len: int) -> int:
    """Target tokens that count towards the loss in a batch of these sample indices."""
    return sum(i != PAD for i in indices) * seq_len


def eval_indices(num_samples: int, global_batch: int, batch: int) -> list[int]:
    """Validation reads the held-out samples in order; past their end, PAD rows."""
    start = batch * global_batch
    return [i if i < num_samples else PAD for i in range(start, start + global_batch)]
