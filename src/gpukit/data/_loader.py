"""DeviceLoader: a DataLoader whose batches arrive on the device and whose epochs resume.

``build_loader`` (``_build.py``, what ``Session.setup_dataloader`` calls) makes one from a dataset
or an existing DataLoader: one shard per process, pinned memory when the device benefits, seeded
workers and a resumable batch sampler.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from gpukit.accelerators import Accelerator
from gpukit.placement import device_mover
from gpukit.data._advice import LoaderFacts, cpu_share_now, diagnose, loader_facts
from gpukit.data._sampler import ResumableBatchSampler
from gpukit.data._position import DataPosition, position_of
from gpukit.data._shard import batches_per_rank, real_samples, shard_note
from gpukit.data._stall import StallGuard, resolve_data_timeout
from gpukit.data._timing import PassTotals, StepTimings
from gpukit.data._epoch_gather import EpochGather
from gpukit.data._pinned import PinnedMover
from gpukit.data._tune_result import TuneResult

__all__ = ["DeviceLoader", "LoaderListener", "LoaderPlace"]

class LoaderListener:
    """Told where a :class:`DeviceLoader` is (the Session's accumulation and ``gather_for_metrics``
    need to know the batch in hand and how many are left). The base methods do nothing."""

    def pass_started(self, loader: DeviceLoader) -> None:
        """A pass (an epoch, or the rest of one after a resume) begins."""

    def batch(self, loader: DeviceLoader) -> None:
        """``loader`` is about to hand out its next batch (``batches_consumed`` counts it already)."""

    def pass_ended(self, loader: DeviceLoader) -> None:
        """The pass ran to its end."""


@dataclass(frozen=True)
class LoaderPlace:
    """Where a loader runs: this process's device and its place among the ranks.

    Attributes:
        device, accelerator: where batches go, and what its backend gains from (pinned memory).
        rank, world_size, local_world_size: this process's rank, the ranks in all, on this node.
        seed: the shuffle's and the workers' seed (the same on every rank).
        broadcast: rank 0's value to every rank (``num_workers="tune"`` measures once); ``None``:
            each process on its own.
        timings: the session's step-time breakdown (``None``: the loader keeps its own).
        listener: told which batch is in hand (the session's accumulation and gathers).
    """

    device: torch.device
    accelerator: Accelerator
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    seed: int = 0
    broadcast: Callable[[Any], Any] | None = None
    timings: StepTimings | None = None
    listener: LoaderListener | None = None


class DeviceLoader:
    """Iterate a DataLoader with batches moved to ``device``; epochs advance on their own.

    Each ``for batch in loader`` is one epoch: the sampler is given the epoch number (so the
    shuffle changes per epoch, identically on every rank), and a pass that started advances
    the epoch when the next one begins. ``set_epoch`` overrides the count.
    ``state_dict``/``load_state_dict`` carry (epoch, samples of the epoch's global order consumed,
    seed): a fresh process that loads them continues with exactly the next batch -- under another
    number of ranks or batch size too, where the rest of the epoch is cut over the ranks there are now
    (every sample not yet seen this epoch is seen once). Every step is timed into
    ``timings`` (the session's :class:`~gpukit.data.StepTimings`, or the loader's own), and
    each epoch ends with an :class:`~gpukit.data.EpochReport` there (on rank 0, gathered from
    every rank under DDP without a collective: a pass on rank 0 alone does not hang). A wait for a batch longer than
    ``data_timeout_s`` raises :class:`~gpukit.errors.DataStallError`.
    """

    def __init__(
        self,
        loader: DataLoader,
        place: LoaderPlace,
        *,
        move_to_device: bool = True,
        resumable: bool = True,
        data_timeout_s: float | None = None,
        tuned: TuneResult | None = None,
        pinned_pool: bool = False,
        global_draws: tuple[int, int] = (0, 0),
    ) -> None:
        self.loader = loader
        #: numbers torch's own DataLoader would draw from the global RNG when a pass starts, at the first
        #: pass and at later ones (see ``torch_global_draws``): drawn and dropped, so the user's stream
        #: (dropout masks, augmentation) is where it would be without gpukit
        self.global_draws = global_draws
        self._passes = 0
        self._accelerator = place.accelerator
        #: batches are pinned through a pool of reused buffers (the DataLoader itself does not pin)
        self.pinned_pool = pinned_pool and move_to_device
        self._listener = place.listener if place.listener is not None else LoaderListener()
        self.timings = place.timings if place.timings is not None else StepTimings()
        self.local_world_size = place.local_world_size
        self._guard = StallGuard(loader, resolve_data_timeout(data_timeout_s))
        self.device = place.device if move_to_device else None
        self.seed = place.seed
        self.world_size = world_size = place.world_size
        self._batch_sampler = loader.batch_sampler if resumable else None
        # only gpukit's sharding gives every rank the same passes, so only then is the
        # end-of-epoch report gathered from every rank (through the store: no collective)
        sharded = world_size > 1 and isinstance(self._batch_sampler, ResumableBatchSampler)
        self._gather = EpochGather(self.timings.rank, world_size) if sharded else None
        self.batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        self._epoch = 0
        #: batches of this epoch handed out, counted as if the pass had started at the epoch's beginning
        #: under this job's ranks and batch size (``len(self) - batches left``)
        self._consumed = 0
        #: a pass resumed at a position saved under other ranks or batch size: the position of the epoch's
        #: global order it starts at, and how many of this layout's batches that counts as (else 0, 0)
        self._start = 0
        self._before = 0
        self._in_progress = False
        self._move: Callable[[Any], Any] | None = None
        self._facts: LoaderFacts | None = None
        #: how ``num_workers="tune"`` chose this loader's settings (``None``: not tuned)
        self.tuned: TuneResult | None = tuned

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        return self._consumed

    @property
    def samples_consumed(self) -> int | None:
        """Positions of this epoch's global order consumed by every rank together (a prefix of that order:
        rank ``r``'s ``p``-th sample is position ``p * W + r`` of the pass's rest); ``None`` when gpukit
        did not shard the data (an iterable dataset, a sampler of the user's own)."""
        sampler = self.shard_sampler
        if sampler is None or self.batch_size is None:
            return None
        remaining = max(0, len(sampler.dataset) - self._start)  # type: ignore[arg-type]
        done = (self._consumed - self._before) * self.batch_size * sampler.num_replicas
        return self._start + min(done, remaining)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def in_pass(self) -> bool:
        """Whether a pass is under way (a batch of it was handed out and it has not ended)."""
        return self._in_progress

    @property
    def shard_sampler(self) -> DistributedSampler | None:
        """The sampler of this rank's shard when gpukit sharded the data (else ``None``)."""
        if isinstance(self._batch_sampler, ResumableBatchSampler):
            return self._batch_sampler.sampler
        return None

    def samples_in_batch(self) -> tuple[int, int] | None:
        """``(samples, real)`` of the batch last handed out: its length, and how many of them are not
        padding repeats (see ``even_batches`` in :mod:`gpukit.data._shard`); ``None`` when gpukit did
        not shard the data."""
        sampler = self.shard_sampler
        if sampler is None or self._consumed <= self._before or self.batch_size is None:
            return None
        return real_samples(sampler, self._consumed - 1 - self._before, self.batch_size, self._start)

    def shard_note(self) -> str | None:
        """One line on what sharding does to this dataset (padding, dropping), ``None`` when it divides."""
        sampler = self.shard_sampler
        return None if sampler is None else shard_note(sampler)

    def batches_per_rank(self) -> list[int] | None:
        """Every rank's batches in this pass (the epoch's; they differ only with ``even_batches=False``);
        ``None`` when gpukit did not shard the data."""
        sampler = self.shard_sampler
        if sampler is None or self.batch_size is None:
            return None
        return batches_per_rank(sampler, self.batch_size, bool(self._batch_sampler.drop_last),  # type: ignore[union-attr]
                                self._start)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (keeps a restored position in that same epoch)."""
        if epoch != self._epoch:
            self._epoch, self._consumed, self._start, self._before = int(epoch), 0, 0, 0
        self._in_progress = False

    def __iter__(self) -> Iterator[Any]:
        self._listener.pass_started(self)  # may refuse the pass (uneven batch counts) before it counts
        if self._in_progress:  # the previous pass was cut short: this is the next epoch
            self._epoch, self._consumed, self._start, self._before = self._epoch + 1, 0, 0, 0
        self._in_progress = True
        skip = self._consumed
        if not (skip or self._start):  # a pass resumed mid-way drew these at its start, before the checkpoint's RNG state
            for _ in range(self.global_draws[0 if self._passes == 0 else 1]):
                torch.empty((), dtype=torch.int64).random_()
        self._passes += 1
        batches: Iterator[Any]
        if isinstance(self._batch_sampler, ResumableBatchSampler):
            self._batch_sampler.set_epoch(self._epoch)
            if self._start:  # resumed at a position saved under other ranks or batch size
                self._batch_sampler.start_sample, self._batch_sampler.first_index = self._start, self._before
            else:
                self._batch_sampler.skip_batches = skip
            batches = raw = iter(self.loader)
        else:
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self._epoch)
            # an order gpukit does not control can only be skipped by drawing batches
            raw = iter(self.loader)
            batches = itertools.islice(raw, skip, None)
        if self._move is None and self.device is not None:
            self._move = device_mover(self.device)  # resolved once, not per batch
            if self.pinned_pool:
                self._move = PinnedMover(self.device, self._accelerator, self._move)
        if isinstance(self._batch_sampler, ResumableBatchSampler):
            # augmentation seeds only matter to workers; without them, plain index lists
            self._batch_sampler.seeded = bool(self.loader.num_workers)
        move = self._move
        guard = self._guard
        listener = self._listener
        guard.begin(raw)
        try:
            for batch in self.timings.iterate(
                batches, epoch=self._epoch, move=move, fetch=guard.fetch, on_pass_end=self._pass_end,
                device=self.device if isinstance(self.device, torch.device) else None,
            ):
                self._consumed += 1
                listener.batch(self)
                yield batch
                del batch  # no second holder while the next batch is made (see _timing.iterate)
        finally:
            guard.end()
        self._epoch, self._consumed, self._in_progress = self._epoch + 1, 0, False
        self._start = self._before = 0
        listener.pass_ended(self)

    def _pass_end(self, totals: PassTotals) -> None:
        per_rank = self.timings.gather_pass(totals, self._gather)
        if self._facts is None:  # the loader's settings do not change between epochs
            copies = self.device is not None and not self.timings.accelerator.is_host
            self._facts = loader_facts(self.loader, self.timings.accelerator, self.local_world_size,
                                       copies, tuned=self.tuned, pinned=self.pinned_pool or None)
        report = diagnose(per_rank, self._facts, cpu_share_now())  # others' use of the CPUs: measured
        if "retune" in report.causes and self.tuned is not None:
            self.tuned.forget()  # the next run measures again instead of trusting the cache
        self.timings.record_epoch(report)

    def state_dict(self) -> dict[str, Any]:
        """Position in the data: ``{"epoch", "samples_consumed", "batches_consumed", "seed", "batch_size",
        "world_size", "dataset_size"}``; after a finished pass, the next epoch with 0 consumed.
        ``samples_consumed`` (positions of the epoch's global order done by all ranks together) is what
        resuming reads; a loader gpukit does not shard has none (its position is batches drawn)."""
        state: dict[str, Any] = {
            "epoch": self._epoch,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }
        samples = self.samples_consumed
        if samples is not None:
            state["samples_consumed"] = samples
            state["dataset_size"] = len(self.dataset)  # type: ignore[arg-type]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next pass yields the next unseen samples.

        A loader gpukit shards resumes a position saved under any number of ranks and batch size: the
        rest of that epoch's order is cut over this job's ranks (``gpukit.data._shard``). A state of
        the older form (batches consumed, with its world size and batch size) counts as
        ``batches x batch_size x world_size`` samples. A loader gpukit does not shard can only skip
        batches, so its mid-epoch state needs the same world size and batch size.

        Raises:
            CheckpointError: a mid-epoch state of another dataset size (another order), or of a loader
                gpukit does not shard saved under another world size or batch size.
        """
        sampler = self.shard_sampler
        position = position_of(state, self.dataset, sharded=sampler is not None, batch_size=self.batch_size,
                               world_size=self.world_size)
        self._place(position)
        self._in_progress = False
        if "seed" in state and state["seed"] is not None:
            self.seed = int(state["seed"])
            if sampler is not None:
                sampler.seed = self.seed

    def _place(self, position: DataPosition) -> None:
        """Put the next pass at ``position`` (as skipped batches where it falls on one of this layout's)."""
        self._epoch, self._start, self._before = position.epoch, 0, 0
        self._consumed = position.batches
        sampler = self.shard_sampler
        if sampler is None or self.batch_size is None or position.samples is None:
            return
        per_batch = self.batch_size * sampler.num_replicas
        if position.samples % per_batch == 0:  # the same samples as skipping whole batches: the exact path
            self._consumed = position.samples // per_batch
            return
        self._start = position.samples
        left = batches_per_rank(sampler, self.batch_size, bool(self._batch_sampler.drop_last),  # type: ignore[union-attr]
                                position.samples)
        self._before = self._consumed = max(0, len(self) - max(left, default=0))

    def __getattr__(self, name: str) -> Any:
        # anything else (batch_size, num_workers, sampler...) is the DataLoader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return (
            f"DeviceLoader(batches={len(self)}, device={self.device}, epoch={self._epoch}, "
            f"batches_consumed={self._consumed})"
        )
