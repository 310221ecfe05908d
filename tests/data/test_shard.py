"""gpukit.data._shard: where the padding repeats of DistributedSampler sit, for every small case.

The same arithmetic tells ``session.gather_for_metrics`` which gathered rows to drop; here it is
checked against the samplers themselves (no processes needed: a sampler takes its rank as an
argument) -- every N, world size and batch size up to a dozen, shuffled or not.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler

from gpukit.data._shard import (
    UnevenSampler,
    batches_per_rank,
    make_sampler,
    parse_even_batches,
    real_samples,
    shard_note,
)
from gpukit.errors import ConfigurationError

CASES = list(itertools.product(range(1, 13), range(1, 5), range(1, 5), (False, True)))


def _rank_batches(n: int, world: int, batch: int, shuffle: bool, mode, drop_last: bool = False):
    data = list(range(n))
    samplers = [make_sampler(data, world_size=world, rank=r, shuffle=shuffle, seed=3, even_batches=mode)
                for r in range(world)]
    return samplers, [list(BatchSampler(s, batch, drop_last)) for s in samplers]


def test_padded_shards_minus_the_repeats_are_the_epoch_order() -> None:
    for case in CASES:
        _check_padded(*case)


def _check_padded(n: int, world: int, batch: int, shuffle: bool) -> None:
    samplers, per_rank = _rank_batches(n, world, batch, shuffle, "pad")
    steps = max(len(b) for b in per_rank)
    assert all(len(b) == steps for b in per_rank)  # padding: the same number of batches everywhere
    joined = []
    for j in range(steps):
        kept = []
        for r in range(world):
            length, real = real_samples(samplers[r], j, batch)
            assert length == len(per_rank[r][j])
            kept.append(per_rank[r][j][:real])
        # row-major over (position in batch, rank): the epoch's order
        for p in range(batch):
            joined += [k[p] for k in kept if p < len(k)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist() if shuffle else list(range(n))
    assert joined == order, (n, world, batch, shuffle)


def test_uneven_shards_cover_each_sample_once_and_counts_are_predicted() -> None:
    for case in CASES:
        _check_uneven(*case)


def _check_uneven(n: int, world: int, batch: int, shuffle: bool) -> None:
    for drop_last in (False, True):
        samplers, per_rank = _rank_batches(n, world, batch, shuffle, False, drop_last)
        assert batches_per_rank(samplers[0], batch, drop_last) == [len(b) for b in per_rank]
        if not drop_last:
            assert sorted(i for b in per_rank for batch_ in b for i in batch_) == list(range(n))
    assert isinstance(samplers[0], UnevenSampler)


@pytest.mark.parametrize(("n", "world"), [(11, 2), (10, 3), (7, 4)])
def test_drop_leaves_out_the_remainder_and_says_so(n: int, world: int) -> None:
    samplers, per_rank = _rank_batches(n, world, 2, False, "drop")
    seen = sorted(i for b in per_rank for batch in b for i in batch)
    assert seen == list(range(n - n % world))
    assert f"the last {n % world} of each epoch's order are left out" in shard_note(samplers[0])


def test_notes_say_what_padding_does() -> None:
    pad = make_sampler(list(range(11)), world_size=2, rank=0, shuffle=False, seed=0, even_batches="pad")
    assert shard_note(pad) == ("11 samples over 2 ranks: 1 sample(s) repeated so every rank gets 6 "
                               "(even_batches='pad'; session.gather_for_metrics drops the repeats)")
    assert shard_note(make_sampler(list(range(12)), world_size=2, rank=0, shuffle=False, seed=0,
                                   even_batches="pad")) is None


@pytest.mark.parametrize("value", ["even", 1, None])
def test_even_batches_accepts_pad_drop_false(value) -> None:
    assert parse_even_batches(True) == "pad" and parse_even_batches(False) is False
    with pytest.raises(ConfigurationError, match="'pad' \\(or True"):
        parse_even_batches(value)
