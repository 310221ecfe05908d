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

A winner with workers is confirmed against ``num_workers=0``, both measured again side by
side: it must win by more than the spread between a setting's two measurements (at least
:data:`_GAIN`), otherwise the simpler setting is kept. Each trial is bounded in time; when
the budget runs out before the search is done, the result says so (``complete=False``), the
best measured is used for this run and nothing is cached.

A complete result is cached per (dataset fingerprint, batch size, machine) in
``$GPUKIT_CACHE_DIR/loader_tuning.json`` (default ``~/.cache/gpukit``; see ``_tune_cache``),
so the next run starts tuned; ``GPUKIT_RETUNE=1`` measures again, and an epoch whose loader is
much slower than tuning measured drops the entry (see ``_advice``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from gpukit._util.envvars import TUNE_BUDGET_ENV
from gpukit.accelerators import Accelerator
from gpukit.data._loader_settings import LoaderSettings
from gpukit.data._tune_cache import RETUNE_ENV, _cache_key, _read_cache, _write_cache
from gpukit.data._tune_result import DEFAULT_TUNE_BUDGET_S, Trial, TuneResult
from gpukit.data._workers import usable_cpu_count
from gpukit.errors import ConfigurationError

__all__ = [
    "DEFAULT_TUNE_BUDGET_S", "LoaderSettings", "Trial", "TuneResult", "tune_for_ranks",
    "tune_loader",
]

_GAIN = 1.05  # a setting must be 5% faster to replace the best so far
_MIN_BATCHES = 3  # batches a trial times at least (when the dataset has them)
_CONFIRM_BY = 3.0  # confirm a winner with workers only while within 3x the budget (wall time)
_WALL_CAP = 3.0  # no new candidate after 3x the budget of wall time (start-ups included)


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
        env = os.environ.get(TUNE_BUDGET_ENV)
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
    if cache and os.environ.get(RETUNE_ENV) != "1":
        cached = _read_cache(key)
        if cached is not None:
            result = TuneResult(cached[0], (), 0.0, True, key, budget_s=time_budget_s, batches_per_s=cached[1])
            if verbose:
                print(result.report(), flush=True)
            return result
    start = time.perf_counter()
    trials: list[Trial] = []
    planned = 1 + len(_worker_counts(cap)) + 1 + int(copies and accelerator.benefits_from_pinned_memory)
    slice_s = time_budget_s / planned
    consume = _consumer(step_fn, target)
    search = _Search(trials, cap, copies and accelerator.benefits_from_pinned_memory, start, time_budget_s)
    for settings in search.run(planned, verbose):
        trials.append(_measure(dataset, batch_size, settings, collate_fn, consume, slice_s))
    winner = _fastest(trials)
    complete = not search.cut
    if winner is not trials[0]:
        # confirm against num_workers=0, measured again right after: on a machine shared with
        # other work, a slow moment during one trial must not decide
        if complete and time.perf_counter() - start <= _CONFIRM_BY * time_budget_s:
            again = [_measure(dataset, batch_size, t.settings, collate_fn, consume, slice_s)
                     for t in (trials[0], winner)]
            trials += again
            winner = _confirmed(trials[0], winner, *again)
        else:
            complete = False
    best = winner.settings
    if best.num_workers:  # start-up is paid once per run, not once per epoch
        best = replace(best, persistent_workers=True)
    result = TuneResult(best, tuple(trials), time.perf_counter() - start, False, key, complete,
                        time_budget_s, winner.batches_per_s)
    if cache and complete:  # an incomplete search is never remembered
        _write_cache(key, best, winner.batches_per_s)
    if verbose:
        print(result.report(), flush=True)
    return result


def tune_for_ranks(
    dataset: Dataset, batch_size: int, *, device: torch.device | None, rank: int, world_size: int,
    local_world_size: int, broadcast: Callable[[Any], Any] | None, verbose: bool,
) -> TuneResult:
    """``num_workers="tune"``: rank 0 tunes (for its share of the node's CPUs) and every rank
    gets its result; without ``broadcast`` (no session) each process tunes for itself."""
    shared = world_size > 1 and broadcast is not None
    result = None
    if rank == 0 or not shared:
        result = tune_loader(dataset, batch_size, device=device, local_world_size=local_world_size,
                             verbose=verbose and rank == 0)
    if shared:
        result = broadcast(result)  # type: ignore[misc]
    return result  # type: ignore[return-value]


def _confirmed(first_simple: Trial, first_other: Trial, again_simple: Trial, again_other: Trial) -> Trial:
    """The simpler setting unless the other beats it by more than the measurement's own noise.

    Each setting was measured twice; the margin is the larger of :data:`_GAIN` and the spread
    between a setting's two measurements (how much the same setting moved on this machine).
    """
    def rates(a: Trial, b: Trial) -> tuple[float, float]:
        return a.batches_per_s or 0.0, b.batches_per_s or 0.0

    simple, other = rates(first_simple, again_simple), rates(first_other, again_other)
    spread = max(abs(x - y) / max(min(x, y), 1e-9) for x, y in (simple, other))
    margin = max(_GAIN - 1.0, spread)
    if sum(other) / 2 > sum(simple) / 2 * (1.0 + margin):
        return first_other if first_other.batches_per_s == max(other) else again_other
    return first_simple


def _fastest(trials: list[Trial]) -> Trial:
    """The fastest trial; a later (more costly) setting must beat the best by :data:`_GAIN`."""
    best = trials[0]
    for trial in trials[1:]:
        if (trial.batches_per_s or 0.0) > (best.batches_per_s or 0.0) * _GAIN:
            best = trial
    return best


class _Search:
    """The adaptive search of the module docstring; reads ``trials`` as they are appended.
    ``cut`` tells afterwards whether the time budget stopped it before it was done."""

    def __init__(self, trials: list[Trial], cap: int, try_pinning: bool, start: float, budget_s: float) -> None:
        self.trials, self.cap, self.try_pinning = trials, cap, try_pinning
        self.start, self.budget_s = start, budget_s
        self.cut = False

    def _time_left(self) -> bool:
        # the budget counts measuring time (start-ups add to it, as documented); wall time is
        # capped too, so worker start-ups on a loaded machine cannot stretch it without end
        measured_s = sum(t.measured_s for t in self.trials)
        if measured_s > self.budget_s or time.perf_counter() - self.start > _WALL_CAP * self.budget_s:
            self.cut = True
        return not self.cut

    def _search(self) -> Iterator[LoaderSettings]:
        trials = self.trials
        yield LoaderSettings(0)
        previous: Trial | None = None
        for workers in _worker_counts(self.cap):
            if not self._time_left():
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
        if best.settings.num_workers:
            if not self._time_left():
                return
            yield replace(best.settings, prefetch_factor=4)
        if self.try_pinning:
            if not self._time_left():
                return
            yield replace(_fastest(trials).settings, pin_memory=True)

    def run(self, planned: int, verbose: bool) -> Iterator[LoaderSettings]:
        from gpukit._util.progress import progress

        yield from progress(self._search(), total=planned, description="tuning loader", enabled=verbose)


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
            now = time.perf_counter()
            stamps.append(now)
            timed = len(stamps) - warm
            # enough batches and time; or, with slow batches on a busy machine, a hard stop
            # (two timed batches give a rate) so one trial cannot eat the whole budget
            if (timed >= 2 * _MIN_BATCHES and now - t0 >= slice_s) or (timed >= 2 and now - t0 >= 2 * slice_s):
                break
    finally:
        del it  # shuts the workers down
    return Trial(settings, _steady_rate(stamps[warm - 1:]), stamps[0] - t0 if stamps else 0.0,
                 len(stamps), stamps[-1] - stamps[0] if stamps else 0.0)


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
