"""A batch sampler that can start an epoch part-way through, for mid-epoch resume.

Shuffling comes from :class:`~torch.utils.data.DistributedSampler`, whose order is a
``randperm`` seeded with ``seed + epoch`` -- a pure function of (seed, epoch, rank,
world_size). In one process it is used with ``num_replicas=1`` (same order as a seeded
RandomSampler would give, but reproducible per epoch). Resuming re-creates that order and skips
the batches already consumed as lists of indices: no sample is loaded to be thrown away. A position
saved by another number of ranks (or batch size) is a number of positions of the epoch's global order
(``start_sample``): the pass then cuts the rest of that order over this job's ranks
(:func:`~gpukit.data._shard.rank_positions`).

Each batch also carries a seed derived from (seed, rank, epoch, batch index): a loader worker
re-seeds its generators with it before loading the batch (see ``_workers.seed_batch``), so
random augmentations depend on which batch is loaded, not on which worker loads it or on how
many batches that worker loaded before -- the only way a resumed run, whose workers start
fresh, can draw the same augmentations as the uninterrupted one.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler

from gpukit.data._shard import rank_positions
from gpukit.data._workers import seed_batch

__all__ = ["ResumableBatchSampler", "SeededBatch", "batch_seed"]


class SeededBatch(list):  # type: ignore[type-arg]
    """A batch of indices (a plain list to every consumer) that knows its augmentation seed."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __iter__(self) -> Iterator[Any]:
        # the fetcher iterates the batch right before it loads the samples (in a worker)
        seed_batch(self.seed)
        return super().__iter__()

    def __reduce__(self) -> tuple[Any, ...]:  # sent to workers through a queue
        return (SeededBatch, (list(list.__iter__(self)), self.seed))


def batch_seed(seed: int, rank: int, epoch: int, index: int) -> int:
    """A 63-bit seed that is a pure function of (seed, rank, epoch, batch index)."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ResumableBatchSampler(BatchSampler):
    """BatchSampler over a DistributedSampler, with ``skip_batches`` for the next pass only."""

    sampler: DistributedSampler

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.skip_batches = 0
        #: the next pass starts at this position of the epoch's global order (0: as ``skip_batches`` says),
        #: and numbers its first batch ``first_index`` (its augmentation seed); for the next pass only
        self.start_sample = 0
        self.first_index = 0
        #: give batches their augmentation seeds; only workers use them (``seed_batch`` is a
        #: no-op in the training process), so a loader without workers turns this off
        self.seeded = True

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the skip is read and cleared when the first batch is drawn, not when
        # iter() is called -- torch's multi-worker iterator calls iter() twice (in __init__ and
        # in _reset) and draws only from the second; clearing on the first call lost the skip.
        skip, self.skip_batches = self.skip_batches, 0
        start, self.start_sample = self.start_sample, 0
        first, self.first_index = self.first_index, 0
        s = self.sampler
        if start:  # batches numbered from ``first`` on: the batches of this epoch before them are done
            batches: Iterator[list[int]] = self._batches_from(start)
            numbered = enumerate(batches, first)
        else:
            batches = itertools.islice(super().__iter__(), skip, None)
            numbered = enumerate(batches, skip)
        if not self.seeded:
            yield from batches
            return
        for index, batch in numbered:
            yield SeededBatch(batch, batch_seed(s.seed, s.rank, s.epoch, index))

    def _batches_from(self, start: int) -> Iterator[list[int]]:
        """This rank's batches of the rest of the epoch from global position ``start``."""
        indices = rank_positions(self.sampler, start)
        size = self.batch_size
        for begin in range(0, len(indices), size):
            batch = indices[begin:begin + size]
            if len(batch) == size or not self.drop_last:
                yield batch
