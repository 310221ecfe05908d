"""A batch sampler that can start an epoch part-way through, for mid-epoch resume.

Shuffling comes from :class:`~torch.utils.data.DistributedSampler`, whose order is a
``randperm`` seeded with ``seed + epoch`` -- a pure function of (seed, epoch, rank,
world_size). In one process it is used with ``num_replicas=1`` (same order as a seeded
RandomSampler would give, but reproducible per epoch). Resuming re-creates that order and skips
the batches already consumed as lists of indices: no sample is loaded to be thrown away.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch.utils.data import BatchSampler, DistributedSampler

__all__ = ["ResumableBatchSampler"]


class ResumableBatchSampler(BatchSampler):
    """BatchSampler over a DistributedSampler, with ``skip_batches`` for the next pass only."""

    sampler: DistributedSampler

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.skip_batches = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # read and clear eagerly: DataLoader calls iter() (and prefetches) before the first batch
        skip, self.skip_batches = self.skip_batches, 0
        batches = super().__iter__()
        return itertools.islice(batches, skip, None) if skip else batches
