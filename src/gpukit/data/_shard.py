"""How a dataset of N samples is cut into ``world_size`` shards, and what that does at the end.

N samples rarely divide by the number of processes. :class:`~torch.utils.data.DistributedSampler`
then *pads*: it repeats the first samples of the epoch's order until every rank has
``ceil(N / W)``, so every rank runs the same number of batches (no rank waits in a collective for
one that has finished) -- but a gathered evaluation then counts those samples twice. The
``even_batches`` setting of ``Session.setup_dataloader`` chooses:

* ``"pad"`` (default, also ``True``): as torch. ``session.gather_for_metrics`` drops the repeats,
  because where they sit is known: rank ``r``'s ``p``-th sample is position ``p * W + r`` of the
  epoch's order, and positions from N on are the repeats.
* ``"drop"``: the last ``N mod W`` samples of the epoch's order are left out (every rank gets
  ``floor(N / W)``); no sample is seen twice, a few are not seen that epoch.
* ``False``: no padding and nothing dropped: rank ``r`` gets positions ``r, r + W, ...``, so ranks may
  get different numbers of samples -- and of batches, which under DDP needs ``session.join``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from gpukit.errors import ConfigurationError

__all__ = ["UnevenSampler", "batches_per_rank", "make_sampler", "parse_even_batches", "real_samples",
           "shard_note"]

_MODES = ("pad", "drop", False)


def parse_even_batches(value: Any) -> str | bool:
    """``"pad"``, ``"drop"`` or ``False`` from what the user gave (``True`` means ``"pad"``).

    Raises:
        ConfigurationError: anything else.
    """
    if value is True:
        return "pad"
    if value is False or value in ("pad", "drop"):
        return value
    raise ConfigurationError(
        f"even_batches={value!r}; use 'pad' (or True: repeat a few samples so every rank gets the "
        "same number; gather_for_metrics drops them), 'drop' (leave the last N mod world_size "
        "samples out) or False (no padding: ranks may get different numbers of batches)."
    )


class UnevenSampler(DistributedSampler):
    """DistributedSampler without padding: rank ``r`` takes positions ``r, r + W, ...`` of the epoch's
    order (the same order as DistributedSampler's: ``randperm`` seeded with ``seed + epoch``)."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        n = len(dataset)
        self.num_samples = len(range(rank, n, num_replicas))
        self.total_size = n

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        return iter(order[self.rank::self.num_replicas])


def make_sampler(dataset: Any, *, world_size: int, rank: int, shuffle: bool, seed: int,
                 even_batches: str | bool) -> DistributedSampler:
    """The sampler of one rank's shard for ``even_batches`` (see the module docstring)."""
    if even_batches is False:
        return UnevenSampler(dataset, world_size, rank, shuffle, seed)
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                              drop_last=even_batches == "drop")


def real_samples(sampler: DistributedSampler, batch_index: int, batch_size: int) -> tuple[int, int]:
    """``(samples, real)`` of this rank's batch ``batch_index``: its length, and how many of them are
    not padding repeats.

    Rank ``r``'s position ``p`` is the epoch's position ``p * W + r``; positions from N on repeat
    earlier samples, so the real ones are the first ``len(range(r, N, W)) - batch_index * B``.
    """
    start = batch_index * batch_size
    in_batch = max(0, min(batch_size, sampler.num_samples - start))
    real = len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas)) - start  # type: ignore[arg-type]
    return in_batch, max(0, min(in_batch, real))


def batches_per_rank(sampler: DistributedSampler, batch_size: int, drop_last: bool) -> list[int]:
    """Every rank's number of batches per epoch, for ``sampler``'s setting (the same formula on every rank)."""
    n, world = len(sampler.dataset), sampler.num_replicas  # type: ignore[arg-type]
    if isinstance(sampler, UnevenSampler):
        counts = [len(range(r, n, world)) for r in range(world)]
    else:
        counts = [sampler.num_samples] * world
    return [c // batch_size if drop_last else math.ceil(c / batch_size) for c in counts]


def shard_note(sampler: DistributedSampler) -> str | None:
    """One line on what sharding does to this dataset (padding or dropping), ``None`` when it divides."""
    n, world = len(sampler.dataset), sampler.num_replicas  # type: ignore[arg-type]
    extra = n % world
    if world == 1 or extra == 0:
        return None
    if isinstance(sampler, UnevenSampler):
        return (f"{n} samples over {world} ranks: {extra} rank(s) get one sample more "
                "(even_batches=False; ranks with fewer batches finish first -- use session.join)")
    if sampler.drop_last:
        return (f"{n} samples over {world} ranks: the last {extra} of each epoch's order are left out "
                f"so every rank gets {n // world} (even_batches='drop')")
    repeats = world - extra
    return (f"{n} samples over {world} ranks: {repeats} sample(s) repeated so every rank gets "
            f"{math.ceil(n / world)} (even_batches='pad'; session.gather_for_metrics drops the repeats)")
