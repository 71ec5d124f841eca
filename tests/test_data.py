"""The bundled corpus and the distributed sampler: pure, no processes."""

from collections import Counter

import pytest
import torch

from paratrain.models.gpt import IGNORE_INDEX
from paratrain.train.data import (PAD, DistributedSampler, Samples, eval_indices, load_corpus,
                                  split, valid_tokens)


def test_bundled_corpus_is_english_bytes():
    tokens = load_corpus()
    assert tokens.dtype == torch.uint8 and len(tokens) > 400_000
    text = bytes(tokens[:2000].tolist()).decode()
    assert "statement" in text
    train, val = split(tokens, 0.05)
    assert len(train) + len(val) == len(tokens) and 0.04 < len(val) / len(tokens) < 0.06


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_each_sample_visited_once_per_epoch_across_ranks(dp, remainder):
    num, batch = 103, 8
    samplers = [DistributedSampler(num, batch, r, dp, seed=3, remainder=remainder) for r in range(dp)]
    steps = samplers[0].steps_per_epoch
    seen = Counter(i for s in samplers for step in range(steps) for i in s.local_indices(step))
    pads = seen.pop(PAD, 0)
    assert all(c == 1 for c in seen.values())
    if remainder == "pad":
        assert set(seen) == set(range(num)) and pads == steps * batch - num
    else:
        assert len(seen) == num - num % batch and pads == 0
        assert samplers[0].dropped_per_epoch == num % batch


def test_ranks_take_disjoint_contiguous_slices_of_the_same_global_batch():
    a, b = (DistributedSampler(50, 4, r, 2, seed=1) for r in range(2))
    assert a.global_indices(5) == b.global_indices(5)
    assert a.local_indices(5) + b.local_indices(5) == a.global_indices(5)


def test_epochs_reshuffle_deterministically():
    s = DistributedSampler(40, 8, 0, 1, seed=0)
    assert s.global_indices(0) != s.global_indices(5)  # step 5 is epoch 1, step 0
    assert s.global_indices(5) == DistributedSampler(40, 8, 0, 1, seed=0).global_indices(5)


def test_too_small_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedSampler(3, 8, 0, 1)


def test_pad_rows_are_masked():
    samples = Samples(torch.arange(100, dtype=torch.uint8), seq_len=8)
    tokens, targets = samples.batch([1, PAD])
    assert tokens[0].tolist() == list(range(8, 16)) and targets[0].tolist() == list(range(9, 17))
    assert (targets[1] == IGNORE_INDEX).all()
    assert valid_tokens([1, PAD, 2], 8) == 16
    assert eval_indices(5, 4, 1) == [4, PAD, PAD, PAD]
