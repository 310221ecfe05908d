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

**Resuming at another size.** A position in the data is a number of the epoch's order's positions
already consumed (``start``): a checkpoint saved by ``W`` ranks after ``k`` batches of ``B`` holds
``k * B * W``. The rest of the epoch, positions ``start, start + 1, ...``, is cut the same way over the
ranks there are now (rank ``r`` takes ``start + r, start + r + W', ...``; padding repeats the epoch's
first samples, as torch does), so every sample not yet seen this epoch is seen once and none twice,
whatever the number of ranks before and after. With ``start = 0`` this is exactly the sampler's own order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from gpukit.errors import ConfigurationError

__all__ = ["UnevenSampler", "batches_per_rank", "epoch_order", "make_sampler", "parse_even_batches",
           "rank_positions", "real_samples", "samples_per_rank", "shard_note"]

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
        return iter(epoch_order(self)[self.rank::self.num_replicas])


def epoch_order(sampler: DistributedSampler) -> list[int]:
    """The epoch's global order of sample indices: ``randperm`` seeded with ``seed + epoch`` when shuffling
    (as DistributedSampler), else ``0, 1, ...`` -- the same on every rank, whatever their number."""
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(n))
    generator = torch.Generator()
    generator.manual_seed(sampler.seed + sampler.epoch)
    return torch.randperm(n, generator=generator).tolist()


def _samples_of(sampler: DistributedSampler, rank: int, remaining: int) -> int:
    """Samples of ``rank`` when ``remaining`` positions of the epoch's order are left to share out."""
    world = sampler.num_replicas
    if isinstance(sampler, UnevenSampler):
        return len(range(rank, remaining, world))
    if sampler.drop_last:
        return remaining // world
    return math.ceil(remaining / world)


def samples_per_rank(sampler: DistributedSampler, start: int = 0) -> list[int]:
    """Every rank's samples from position ``start`` of the epoch's order to its end (padding included)."""
    remaining = max(0, len(sampler.dataset) - start)  # type: ignore[arg-type]
    return [_samples_of(sampler, rank, remaining) for rank in range(sampler.num_replicas)]


def rank_positions(sampler: DistributedSampler, start: int) -> list[int]:
    """This rank's sample indices from position ``start`` of the epoch's order on (see the module docstring).

    ``start = 0`` gives what iterating ``sampler`` gives (DistributedSampler's padding and dropping,
    or :class:`UnevenSampler`'s shares).
    """
    order = epoch_order(sampler)
    rest = order[start:]
    world, remaining = sampler.num_replicas, len(rest)
    share = _samples_of(sampler, sampler.rank, remaining)
    if not isinstance(sampler, UnevenSampler):
        total = share * world
        if total > remaining and order:  # padding: the epoch's first samples again, as torch pads
            pad = total - remaining
            rest += (order * math.ceil(pad / len(order)))[:pad]
        rest = rest[:total]
    return rest[sampler.rank::world]


def make_sampler(dataset: Any, *, world_size: int, rank: int, shuffle: bool, seed: int,
                 even_batches: str | bool) -> DistributedSampler:
    """The sampler of one rank's shard for ``even_batches`` (see the module docstring)."""
    if even_batches is False:
        return UnevenSampler(dataset, world_size, rank, shuffle, seed)
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                              drop_last=even_batches == "drop")


def real_samples(sampler: DistributedSampler, batch_index: int, batch_size: int,
                 start: int = 0) -> tuple[int, int]:
    """``(samples, real)`` of this rank's batch ``batch_index`` of a pass that began at position ``start``
    of the epoch's order: its length, and how many of them are not padding repeats.

    Rank ``r``'s ``p``-th sample of the pass is the epoch's position ``start + p * W + r``; positions from
    N on repeat earlier samples, so the real ones are the first ``len(range(r, N - start, W)) - batch_index * B``.
    """
    first = batch_index * batch_size
    remaining = max(0, len(sampler.dataset) - start)  # type: ignore[arg-type]
    in_batch = max(0, min(batch_size, _samples_of(sampler, sampler.rank, remaining) - first))
    real = len(range(sampler.rank, remaining, sampler.num_replicas)) - first
    return in_batch, max(0, min(in_batch, real))


def batches_per_rank(sampler: DistributedSampler, batch_size: int, drop_last: bool, start: int = 0) -> list[int]:
    """Every rank's number of batches from position ``start`` of the epoch's order to its end (the whole
    epoch by default), for ``sampler``'s setting (the same formula on every rank)."""
    counts = samples_per_rank(sampler, start)
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
