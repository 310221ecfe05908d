"""Where a loader's state puts the next pass: an epoch and the samples of its global order already done.

A :class:`~gpukit.data.DeviceLoader` saves ``samples_consumed``: positions of the epoch's global order
(``randperm(seed + epoch)``, the same on every rank) consumed by all ranks together. That number means
the same under any number of ranks and any batch size, which is what lets a checkpoint taken mid-epoch
by ``N`` ranks resume on ``M``. Checkpoints written before it hold ``batches_consumed`` with the
``world_size`` and ``batch_size`` they were saved under: ``batches x batch_size x world_size`` samples.
A loader gpukit does not shard (an iterable dataset, a sampler of the user's own) knows only how many
batches it drew, so its mid-epoch state resumes only under the same world size and batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpukit.errors import CheckpointError

__all__ = ["DataPosition", "position_of"]


@dataclass(frozen=True)
class DataPosition:
    """A loader's position read from a state.

    Attributes:
        epoch: the epoch the next pass belongs to.
        samples: positions of that epoch's global order done (``None``: the loader counts batches only).
        batches: batches of that epoch already drawn (a loader gpukit does not shard skips these).
    """

    epoch: int
    samples: int | None
    batches: int


def _count(state: Mapping[str, Any], key: str) -> int | None:
    """``state[key]`` as a whole number >= 0, ``None`` when absent."""
    value = state.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"The data-loader state's {key} is {str(value)[:40]!r}, not a whole number >= 0.")
    return value


def position_of(state: Mapping[str, Any], dataset: Any, *, sharded: bool, batch_size: int | None,
                world_size: int) -> DataPosition:
    """The position ``state`` (a :meth:`DeviceLoader.state_dict`, this or an older form) describes.

    Args:
        state: the saved state.
        dataset: the loader's dataset now (its length bounds the position).
        sharded: gpukit shards this loader (its position is samples of the epoch's global order).
        batch_size, world_size: this loader's batch size and data-parallel ranks.

    Raises:
        CheckpointError: a state that is no position, a mid-epoch state of another dataset size, or one
            of a loader gpukit does not shard saved under another world size or batch size.
    """
    if not isinstance(state, Mapping) or _count(state, "epoch") is None:
        raise CheckpointError("The data-loader state has no epoch: it is not a DeviceLoader's state_dict().")
    epoch = int(state["epoch"])
    batches = _count(state, "batches_consumed") or 0
    samples = _count(state, "samples_consumed")
    saved_batch, saved_world = _count(state, "batch_size"), _count(state, "world_size")
    if samples is None and batches and saved_batch and saved_world:  # the older form: per-rank batch counters
        samples = batches * saved_batch * saved_world
    if not sharded:
        if batches:
            _same_layout(state, epoch, batches, batch_size, world_size)
        return DataPosition(epoch, None, batches)
    if samples is None:  # no layout saved: the same one is assumed, as older gpukit did
        samples = batches * (batch_size or 0) * world_size
    size = len(dataset)
    saved_size = _count(state, "dataset_size")
    if samples and saved_size is not None and saved_size != size:
        raise CheckpointError(
            f"Data-loader state was saved mid-epoch ({samples} samples into epoch {epoch}) over a dataset of "
            f"{saved_size} samples; this one has {size}, so that epoch's order is another one. Resume with "
            "the same dataset, or set the state's samples_consumed to 0 to start that epoch over."
        )
    return DataPosition(epoch, min(samples, size), batches)


def _same_layout(state: Mapping[str, Any], epoch: int, batches: int, batch_size: int | None,
                 world_size: int) -> None:
    """Refuse a mid-epoch state of a loader gpukit does not shard saved under another layout."""
    now = {"batch_size": batch_size, "world_size": world_size}
    for key in ("batch_size", "world_size"):
        saved = state.get(key)
        if saved is None or saved == now[key]:
            continue
        fix = (f"Resume with the same number of processes as the checkpoint ({saved})" if key == "world_size"
               else f"Resume with batch_size={saved}")
        raise CheckpointError(
            f"Data-loader state was saved mid-epoch ({batches} batches into epoch {epoch}) with {key}={saved}; "
            f"this run has {key}={now[key]}. This loader is not sharded by gpukit (an iterable dataset or a "
            "sampler of your own), so its position is a count of batches drawn, and the remaining batches "
            f"would be other samples. {fix}, or pass the map-style dataset (or a DataLoader with a plain or "
            "DistributedSampler) to session.setup_dataloader so the position is kept as samples of the "
            "epoch's order, or set the state's batches_consumed to 0 to restart that epoch."
        )
