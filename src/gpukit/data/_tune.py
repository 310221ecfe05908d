"""Loader tuning, measured not guessed: ``tune_loader`` and ``num_workers="tune"``.

Each candidate setting runs a real DataLoader over the dataset for a slice of a bounded time
budget and is scored in batches per second (after its workers started: the start-up is
reported apart, and paid once per run with ``persistent_workers``). The search:

1. ``num_workers=0`` (an in-memory dataset is fastest without the worker round trip);
2. 1, 2, 4, ... workers up to the CPUs of one process (usable CPUs / processes per node),
   stopping when one more step gains less than :data:`_GAIN`;
3. for the best worker count, ``prefetch_factor=4`` against torch's 2;
4. on a device that copies from the host, ``pin_memory`` on against off (batches are moved
   there as the training loop moves them, so the copy is part of the score).

The winner is cached per (dataset fingerprint, batch size, machine) in
``$GPUKIT_CACHE_DIR`` (default ``~/.cache/gpukit``; see ``_tune_cache``), so the next run
starts tuned.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpukit.accelerators import Accelerator
from gpukit.data._tune_cache import _cache_key, _read_cache, _write_cache
from gpukit.data._workers import usable_cpu_count
from gpukit.errors import ConfigurationError

__all__ = [
    "DEFAULT_TUNE_BUDGET_S", "LoaderSettings", "Trial", "TuneResult", "tune_for_ranks",
    "tune_loader",
]

#: total measuring time of one tuning (worker start-ups add to it); GPUKIT_TUNE_BUDGET_S sets it
DEFAULT_TUNE_BUDGET_S = 6.0
_GAIN = 1.05  # a setting must be 5% faster to replace the best so far
_MIN_BATCHES = 3  # batches a trial times at least (when the dataset has them)


@dataclass(frozen=True)
class LoaderSettings:
    """DataLoader settings tuning chooses among."""

    num_workers: int
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.utils.data.DataLoader``."""
        kwargs: dict[str, Any] = dict(num_workers=self.num_workers, pin_memory=self.pin_memory)
        if self.num_workers:
            kwargs["prefetch_factor"] = self.prefetch_factor or 2
            kwargs["persistent_workers"] = self.persistent_workers
        return kwargs

    def short(self) -> str:
        """The measured part of the settings (persistence changes start-ups, not batches/s)."""
        text = f"num_workers={self.num_workers}"
        if self.num_workers:
            text += f", prefetch_factor={self.prefetch_factor or 2}"
        return text + (", pin_memory=True" if self.pin_memory else "")

    def __str__(self) -> str:
        text = f"num_workers={self.num_workers}, pin_memory={self.pin_memory}"
        if self.num_workers:
            text += (f", prefetch_factor={self.prefetch_factor or 2}, "
                     f"persistent_workers={self.persistent_workers}")
        return text


@dataclass(frozen=True)
class Trial:
    """One measured candidate: batches/s after start-up (``None``: no batch came in time)."""

    settings: LoaderSettings
    batches_per_s: float | None
    startup_s: float
    batches: int


@dataclass(frozen=True)
class TuneResult:
    """What tuning tried and chose.

    Attributes:
        settings: the chosen settings.
        trials: every measured candidate, in the order tried (empty when from the cache).
        elapsed_s: time tuning took.
        from_cache: the settings came from an earlier run's tuning on this machine.
        key: the cache key (dataset fingerprint, batch size, machine).
    """

    settings: LoaderSettings
    trials: tuple[Trial, ...]
    elapsed_s: float
    from_cache: bool
    key: str

    def report(self) -> str:
        """Lines for the user: each trial, then the choice."""
        if self.from_cache:
            return f"gpukit: loader settings from the tuning cache ({self.key[:12]}): {self.settings}"
        lines = [f"gpukit: loader tuning ({self.elapsed_s:.1f} s):"]
        for t in self.trials:
            rate = f"{t.batches_per_s:8.1f} batches/s" if t.batches_per_s else "  no batches in time"
            lines.append(f"  {rate}  start-up {t.startup_s:5.2f} s  {t.settings.short()}")
        lines.append(f"  chose {self.settings}")
        return "\n".join(lines)


def tune_loader(
    dataset: Dataset,
    batch_size: int,
    step_fn: Callable[[Any], Any] | None = None,
    *,
    time_budget_s: float | None = None,
    device: torch.device | str | None = None,
    local_world_size: int = 1,
    max_workers: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    cache: bool = True,
    verbose: bool = True,
) -> TuneResult:
    """Measure loader settings for ``dataset`` on this machine and return the fastest.

    Args:
        dataset: a map-style dataset.
        batch_size: batch size per process.
        step_fn: called on each batch as the training step would (then the score is the
            speed of loader and step together); default: the loader alone.
        time_budget_s: total measuring time, split among the candidates (default
            ``$GPUKIT_TUNE_BUDGET_S`` or 6 s; each worker start-up adds to it).
        device: where batches go; a GPU adds the copy to the score and tries ``pin_memory``.
        local_world_size: processes per node sharing the CPUs (caps the worker count).
        max_workers: most workers tried (default: usable CPUs / ``local_world_size``).
        collate_fn: the DataLoader's ``collate_fn``.
        cache: read and write the tuning cache (``$GPUKIT_CACHE_DIR``, ``~/.cache/gpukit``).
        verbose: show a progress bar and print what was tried and chosen.

    Returns:
        A :class:`TuneResult`; ``result.settings.as_kwargs()`` feeds a DataLoader.

    Raises:
        ConfigurationError: bad arguments, or an IterableDataset (no random access to tune on).
    """
    if time_budget_s is None:
        env = os.environ.get("GPUKIT_TUNE_BUDGET_S")
        try:
            time_budget_s = float(env) if env else DEFAULT_TUNE_BUDGET_S
        except ValueError:
            time_budget_s = env  # type: ignore[assignment]  # _check names it
    _check(dataset, batch_size, time_budget_s)
    target = torch.device(device) if device is not None else None
    accelerator = _accelerator(target)
    copies = target is not None and not accelerator.is_host
    cap = max_workers if max_workers is not None else max(1, usable_cpu_count() // max(1, local_world_size))
    key = _cache_key(dataset, batch_size, step_fn, target, local_world_size, cap)
    if cache:
        cached = _read_cache(key)
        if cached is not None:
            result = TuneResult(cached, (), 0.0, True, key)
            if verbose:
                print(result.report(), flush=True)
            return result
    start = time.perf_counter()
    trials: list[Trial] = []
    planned = 1 + len(_worker_counts(cap)) + 1 + int(copies and accelerator.benefits_from_pinned_memory)
    slice_s = time_budget_s / planned
    consume = _consumer(step_fn, target)
    for settings in _candidates(trials, cap, copies and accelerator.benefits_from_pinned_memory,
                                start, time_budget_s, planned, verbose):
        trials.append(_measure(dataset, batch_size, settings, collate_fn, consume, slice_s))
    winner = _fastest(trials)
    if winner is not trials[0]:
        # confirm against num_workers=0, measured again right after: on a machine shared with
        # other work, a slow moment during one trial must not decide
        for settings in (trials[0].settings, winner.settings):
            trials.append(_measure(dataset, batch_size, settings, collate_fn, consume, slice_s))
        winner = _fastest(_best_of_each(trials))
    best = winner.settings
    if best.num_workers:  # start-up is paid once per run, not once per epoch
        best = replace(best, persistent_workers=True)
    result = TuneResult(best, tuple(trials), time.perf_counter() - start, False, key)
    if cache:
        _write_cache(key, best)
    if verbose:
        print(result.report(), flush=True)
    return result


def tune_for_ranks(
    dataset: Dataset, batch_size: int, *, device: torch.device | None, rank: int, world_size: int,
    local_world_size: int, broadcast: Callable[[Any], Any] | None, verbose: bool,
) -> LoaderSettings:
    """``num_workers="tune"``: rank 0 tunes (for its share of the node's CPUs) and every rank
    gets its settings; without ``broadcast`` (no session) each process tunes for itself."""
    shared = world_size > 1 and broadcast is not None
    settings = None
    if rank == 0 or not shared:
        settings = tune_loader(dataset, batch_size, device=device, local_world_size=local_world_size,
                               verbose=verbose and rank == 0).settings
    if shared:
        settings = broadcast(settings)  # type: ignore[misc]
    return settings  # type: ignore[return-value]


def _best_of_each(trials: list[Trial]) -> list[Trial]:
    """One trial per setting, its fastest measurement, in the order first tried."""
    best: dict[LoaderSettings, Trial] = {}
    for trial in trials:
        kept = best.get(trial.settings)
        if kept is None or (trial.batches_per_s or 0.0) > (kept.batches_per_s or 0.0):
            best[trial.settings] = trial
    return list(best.values())  # a dict keeps the order keys were first seen


def _fastest(trials: list[Trial]) -> Trial:
    """The fastest trial; a later (more costly) setting must beat the best by :data:`_GAIN`."""
    best = trials[0]
    for trial in trials[1:]:
        if (trial.batches_per_s or 0.0) > (best.batches_per_s or 0.0) * _GAIN:
            best = trial
    return best


def _candidates(
    trials: list[Trial], cap: int, try_pinning: bool, start: float, budget_s: float,
    planned: int, verbose: bool,
) -> Iterator[LoaderSettings]:
    """The adaptive search of the module docstring; reads ``trials`` as they are appended."""
    from gpukit._util.progress import progress

    def search() -> Iterator[LoaderSettings]:
        yield LoaderSettings(0)
        previous: Trial | None = None
        for workers in _worker_counts(cap):
            if time.perf_counter() - start > budget_s:
                return
            yield LoaderSettings(workers)
            latest = trials[-1]
            # one worker only pays when it overlaps the step; from two on, each doubling must
            if previous is not None and (latest.batches_per_s or 0.0) < (
                previous.batches_per_s or 0.0
            ) * _GAIN:
                break
            previous = latest
        best = _fastest(trials)
        if best.settings.num_workers and time.perf_counter() - start <= budget_s:
            yield replace(best.settings, prefetch_factor=4)
        if try_pinning and time.perf_counter() - start <= budget_s:
            yield replace(_fastest(trials).settings, pin_memory=True)

    yield from progress(search(), total=planned, description="tuning loader", enabled=verbose)


def _worker_counts(cap: int) -> list[int]:
    counts, n = [], 1
    while n < cap:
        counts.append(n)
        n *= 2
    return counts + [cap] if cap >= 1 else counts


def _measure(
    dataset: Dataset, batch_size: int, settings: LoaderSettings,
    collate_fn: Callable[[list[Any]], Any] | None, consume: Callable[[Any], Any], slice_s: float,
) -> Trial:
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, collate_fn=collate_fn,
        generator=torch.Generator().manual_seed(0), **replace(settings, persistent_workers=False).as_kwargs(),
    )
    t0 = time.perf_counter()
    it = iter(loader)
    # a worker's first batch comes with the others' first batches, made in parallel: time from
    # when all of them arrived
    warm = max(1, settings.num_workers)
    stamps: list[float] = []
    try:
        for batch in it:
            consume(batch)
            stamps.append(time.perf_counter())
            if len(stamps) - warm >= 2 * _MIN_BATCHES and stamps[-1] - t0 >= slice_s:
                break
    finally:
        del it  # shuts the workers down
    return Trial(settings, _steady_rate(stamps[warm - 1:]), stamps[0] - t0 if stamps else 0.0,
                 len(stamps))


def _steady_rate(stamps: list[float]) -> float | None:
    """Batches/s over the faster half of the timed window: a machine shared with other work
    slows a trial now and then, and a half it spared shows what the setting can do."""
    n = len(stamps) - 1
    if n < 1:
        return None
    if n < 2 * _MIN_BATCHES:
        return n / max(stamps[-1] - stamps[0], 1e-9)
    half = n // 2
    return max(half / max(stamps[half] - stamps[0], 1e-9),
               (n - half) / max(stamps[-1] - stamps[half], 1e-9))


def _consumer(step_fn: Callable[[Any], Any] | None, device: torch.device | None) -> Callable[[Any], Any]:
    if device is None or device.type == "cpu":
        return step_fn if step_fn is not None else (lambda batch: None)
    from gpukit.placement import to_device

    def consume(batch: Any) -> None:
        moved = to_device(batch, device)
        if step_fn is not None:
            step_fn(moved)

    return consume


def _accelerator(device: torch.device | None) -> Accelerator:
    from gpukit.accelerators import get_accelerator

    return get_accelerator(device) if device is not None else Accelerator()


def _check(dataset: Any, batch_size: Any, budget: Any) -> None:
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ConfigurationError(
            f"tune_loader needs a map-style dataset (with __getitem__ and __len__); got "
            f"{type(dataset).__name__}. Pass num_workers as a number for an IterableDataset."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"batch_size={batch_size!r}; tuning needs an int >= 1.")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigurationError(f"time_budget_s={budget!r}; use a number of seconds > 0.")
