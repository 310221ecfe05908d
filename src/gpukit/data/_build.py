"""build_loader: a dataset, or the user's own DataLoader, made into this process's DeviceLoader.

What ``Session.setup_dataloader`` calls, in four steps:

1. the request (:class:`LoaderRequest`: what was asked) is completed from the loader given, if any
   -- its batch size, workers, collate function... unless overridden -- else torch's defaults;
2. the worker settings (:class:`~gpukit.data.LoaderSettings`): ``num_workers`` "auto" (a rule),
   "tune" (measured on rank 0, the same on every rank) or given, and pinned memory where the
   device gains from it (without workers, from a pool of reused pinned buffers: ``_pinned``);
3. the DataLoader's arguments: those settings, a timeout so a stuck worker is an error (not a
   hang), seeded workers, a generator distinct per rank;
4. the loader: this rank's shard in a batch sampler that resumes mid-epoch -- or, for an
   iterable dataset or a sampler of the user's own, a loader only moved to the device.

Where the loader runs (device, ranks, seed, the session's timings) is a :class:`~gpukit.data.LoaderPlace`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from gpukit.data._loader import DeviceLoader, LoaderPlace
from gpukit.data._loader_settings import LoaderSettings
from gpukit.data._sampler import ResumableBatchSampler
from gpukit.data._shard import make_sampler, parse_even_batches
from gpukit.data._stall import resolve_data_timeout
from gpukit.data._tune import tune_for_ranks
from gpukit.data._tune_result import TuneResult
from gpukit.data._workers import auto_num_workers, chain_worker_init, track_worker_pool
from gpukit.errors import ConfigurationError

__all__ = ["LoaderRequest", "build_loader"]

# DataLoader settings carried over from a loader the user built
_CARRIED = ("collate_fn", "timeout", "multiprocessing_context", "prefetch_factor")
# setup_dataloader's keywords that are not the DataLoader's own
_OWN = ("drop_last", "pin_memory", "move_to_device", "data_timeout_s")


@dataclass(frozen=True)
class LoaderRequest:
    """What ``setup_dataloader`` was asked for (``None``: the given loader's value, else torch's).

    Attributes:
        batch_size, shuffle, num_workers, drop_last, pin_memory: as ``Session.setup_dataloader``.
        move_to_device: batches go to the place's device (``False``: they stay where they are).
        data_timeout_s: longest wait for one batch (``None``: ``GPUKIT_DATA_TIMEOUT_S``, else 600).
        even_batches: "pad", "drop" or False (see ``Session.setup_dataloader``).
        extra: the DataLoader's other arguments (``collate_fn``, ``prefetch_factor``...).
    """

    batch_size: int | None = None
    shuffle: bool | None = None
    num_workers: int | str | None = None
    drop_last: bool | None = None
    pin_memory: bool | None = None
    move_to_device: bool = True
    data_timeout_s: float | None = None
    even_batches: str | bool = "pad"
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, batch_size: int | None = None, shuffle: bool | None = None, num_workers: int | str | None = None,
           even_batches: str | bool = "pad", **kwargs: Any) -> LoaderRequest:
        """``setup_dataloader``'s arguments: its own keywords become fields, the rest ``extra``."""
        own = {name: kwargs.pop(name) for name in _OWN if name in kwargs}
        return cls(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, even_batches=even_batches,
                   extra=kwargs, **own)

    def completed_from(self, given: DataLoader | None) -> LoaderRequest:
        """The request with what it left open taken from ``given`` (the user's loader), else torch's defaults."""
        if given is None:
            return replace(self, batch_size=_default(self.batch_size, 1), drop_last=_default(self.drop_last, False),
                           num_workers=_default(self.num_workers, "auto"))
        carried = {key: getattr(given, key) for key in _CARRIED}
        return replace(
            self, batch_size=_default(self.batch_size, given.batch_size),
            drop_last=_default(self.drop_last, given.drop_last), num_workers=_default(self.num_workers, given.num_workers),
            extra={**carried, "worker_init_fn": given.worker_init_fn, **self.extra},
        )


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def build_loader(data: Dataset | DataLoader, place: LoaderPlace, request: LoaderRequest | None = None) -> DeviceLoader:
    """This process's loader of ``data`` (a Dataset or a DataLoader): see the module docstring.

    Raises:
        ConfigurationError: bad arguments, or a sampler of the user's own under several processes.
    """
    request = request if request is not None else LoaderRequest()
    even_batches = parse_even_batches(request.even_batches)
    given = data if isinstance(data, DataLoader) else None
    dataset = given.dataset if given is not None else data
    request = request.completed_from(given)
    settings, tuned = _worker_settings(dataset, request, place)
    kwargs = _dataloader_kwargs(settings, request, place)
    # without workers torch pins each batch in the training thread anyway: pooled buffers do it cheaper
    pooled = (settings.pin_memory and not settings.num_workers and request.move_to_device
              and place.accelerator.benefits_from_pinned_memory)
    if pooled:
        kwargs["pin_memory"] = False
    # An iterable dataset, or a sampler of the user's own: batches moved to the device, not sharded nor resumed.
    custom = given is not None and not _plain_sampling(given)
    if isinstance(dataset, IterableDataset) or custom:
        if custom and place.world_size > 1:
            raise ConfigurationError(
                f"This DataLoader uses its own sampler ({type(given.sampler).__name__}/"
                f"{type(given.batch_sampler).__name__}); under {place.world_size} processes gpukit "
                "cannot shard it. Pass the dataset instead, or shard it in your sampler and "
                "call setup_dataloader on each rank's own loader with move_to_device only."
            )
        if given is not None:
            return DeviceLoader(given, place, move_to_device=request.move_to_device, resumable=False,
                                data_timeout_s=request.data_timeout_s)
        loader = DataLoader(dataset, batch_size=request.batch_size, drop_last=request.drop_last, **kwargs)
        track_worker_pool(loader)
        return DeviceLoader(loader, place, move_to_device=request.move_to_device, resumable=False,
                            data_timeout_s=request.data_timeout_s, tuned=tuned, pinned_pool=pooled,
                            global_draws=torch_global_draws(given, False))

    # A map-style dataset: this rank's shard, in a batch sampler that resumes mid-epoch.
    shuffle = bool(request.shuffle) if request.shuffle is not None else _shuffles(given)
    sampler = make_sampler(dataset, world_size=place.world_size, rank=place.rank, shuffle=shuffle, seed=place.seed,
                           even_batches=even_batches)
    batch_sampler = ResumableBatchSampler(sampler, request.batch_size, request.drop_last)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    track_worker_pool(loader)
    return DeviceLoader(loader, place, move_to_device=request.move_to_device, data_timeout_s=request.data_timeout_s,
                        tuned=tuned, pinned_pool=pooled, global_draws=torch_global_draws(given, shuffle))


def torch_global_draws(given: DataLoader | None, shuffle: bool) -> tuple[int, int]:
    """How many numbers torch's DataLoader draws from the global RNG when a pass starts, at the first pass
    and at later ones, where gpukit's own loader (seeded by the session) draws none: one for the iterator's
    base seed (once only, with persistent workers), one for a RandomSampler's seed when shuffling -- none
    of either when the user's loader or sampler had a generator of its own. gpukit draws and drops as many,
    so a port's global stream (dropout masks, augmentation) stays where the original script had it."""
    if given is not None and given.generator is not None:
        return (0, 0)
    sampler = given.sampler if given is not None else None
    sampler_draw = int(shuffle and getattr(sampler, "generator", None) is None)
    # as the user's loader would (a dataset alone: torch's defaults), not as gpukit's settings do
    persistent = given is not None and bool(given.num_workers) and bool(given.persistent_workers)
    return (1 + sampler_draw, (0 if persistent else 1) + sampler_draw)


def _worker_settings(dataset: Any, request: LoaderRequest,
                     place: LoaderPlace) -> tuple[LoaderSettings, TuneResult | None]:
    """Step 2: the workers ("auto", "tune" or given) and pinning; the tuning result when measured."""
    workers, pin = request.num_workers, request.pin_memory
    prefetch, persistent = request.extra.get("prefetch_factor"), request.extra.get("persistent_workers")
    tuned = None
    if workers == "auto":
        workers = auto_num_workers(dataset, place.accelerator, place.local_world_size)
    elif workers == "tune":
        tuned = tune_for_ranks(
            dataset, request.batch_size, device=place.device if request.move_to_device else None, rank=place.rank,
            world_size=place.world_size, local_world_size=place.local_world_size, broadcast=place.broadcast,
            verbose=place.timings is not None and place.timings.report,
        )
        chosen = tuned.settings
        workers = chosen.num_workers
        pin = chosen.pin_memory if pin is None else pin
        if workers:
            prefetch = chosen.prefetch_factor
            persistent = chosen.persistent_workers if persistent is None else persistent
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise ConfigurationError(
            f"num_workers={workers!r}; use 'auto', 'tune' (measure on this machine) or an int >= 0."
        )
    if pin is None:
        # pinning a tensor already on the GPU raises "cannot pin 'torch.cuda.FloatTensor' only
        # dense CPU tensors can be pinned": a TensorDataset preloaded on the device gets none
        pin = place.accelerator.benefits_from_pinned_memory and not _holds_device_tensors(dataset)
    # workers that outlive an epoch skip re-forking and re-importing every epoch
    return LoaderSettings(workers, bool(pin), prefetch, persistent_workers=persistent is not False), tuned


def _dataloader_kwargs(settings: LoaderSettings, request: LoaderRequest, place: LoaderPlace) -> dict[str, Any]:
    """Step 3: the DataLoader's keyword arguments."""
    if "generator" in request.extra:  # it would replace the seeded one below without a word
        raise ConfigurationError(
            "setup_dataloader(generator=...): gpukit makes the loader's generator itself, seeded with the "
            "session's seed + rank (each rank's workers differ, a rerun repeats them). Leave generator out "
            "and give the seed as Session(seed=...)."
        )
    kwargs = {key: value for key, value in request.extra.items()
              if key not in ("prefetch_factor", "persistent_workers", "worker_init_fn")}
    kwargs.update(settings.as_kwargs())
    if settings.num_workers == 0:
        kwargs.pop("timeout", None)  # torch refuses a timeout without workers
    elif not kwargs.get("timeout"):  # a stuck worker ends in an error, not a hang
        kwargs["timeout"] = resolve_data_timeout(request.data_timeout_s)
    kwargs["worker_init_fn"] = chain_worker_init(request.extra.get("worker_init_fn"))
    kwargs["generator"] = torch.Generator().manual_seed(place.seed + place.rank)  # worker seeds, distinct per rank
    return kwargs


def _shuffles(given: DataLoader | None) -> bool:
    """Whether the loader the user gave shuffles (a dataset given alone does not, as in torch)."""
    old = given.sampler if given is not None else None
    return isinstance(old, RandomSampler) or (isinstance(old, DistributedSampler) and old.shuffle)


def _holds_device_tensors(dataset: Any) -> bool:
    """Whether ``dataset`` is a TensorDataset whose tensors are not in host memory."""
    return isinstance(dataset, TensorDataset) and any(t.device.type != "cpu" for t in dataset.tensors)


def _plain_sampling(loader: DataLoader) -> bool:
    """Whether the loader samples in a way gpukit can reproduce (plain batches, std sampler)."""
    return (
        loader.batch_size is not None
        and type(loader.batch_sampler) is BatchSampler
        and type(loader.sampler) in (RandomSampler, SequentialSampler, DistributedSampler)
    )
