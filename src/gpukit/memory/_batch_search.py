"""Find the largest batch that fits: doubling, then bisection in log space.

Doubling from ``start`` brackets the limit between the last size that ran and the first that
ran out of memory (a factor of 2). Bisecting that bracket at the geometric mean shrinks the
ratio ``hi / lo`` from 2 to 2**(1/16) ~ 1.044 in four trials, so the answer is within 5% of the
true maximum after ``log2(max / start) + 6`` trials: 12 when the limit is within 128x of ``start``.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpukit._util.units import format_bytes
from gpukit.accelerators import Accelerator, auto_device_type, get_accelerator
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory._fit_planner import resized
from gpukit.memory._host_ram import RAM_HEADROOM, HostRamBudget

__all__ = ["BatchSizeTrial", "BatchSizeResult", "find_batch_size"]

log = logging.getLogger("gpukit.memory")


@dataclass(frozen=True)
class BatchSizeTrial:
    """One trial: ``batch_size`` ran (``fits``) or ran out of memory.

    ``ram_limited`` trials (CPU only) were not run: the RAM they were predicted to need, scaled
    from the trials before, is more than was available (less a 25% margin).
    """

    batch_size: int
    fits: bool
    duration_s: float
    peak_allocated_bytes: int | None
    ram_limited: bool = False


@dataclass(frozen=True)
class BatchSizeResult:
    """Outcome of :func:`find_batch_size`.

    Attributes:
        batch_size: the size to use: ``max_fitting_batch_size`` less the safety margin.
        max_fitting_batch_size: the largest size that ran.
        smallest_failing_batch_size: the smallest size that ran out of memory (``None`` if none did).
        trials: every trial in order.
    """

    batch_size: int
    max_fitting_batch_size: int
    smallest_failing_batch_size: int | None
    trials: tuple[BatchSizeTrial, ...] = field(default_factory=tuple)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"find_batch_size({name}={value!r}): expected an int >= 1.")
    return value


def find_batch_size(
    step_fn: Callable[[int], Any],
    *,
    start: int = 1,
    max: int | None = None,  # noqa: A002 - the documented name of the upper bound
    margin: float = 0.05,
    tolerance: float = 0.05,
    max_trials: int = 30,
    device: str | torch.device | None = None,
    on_trial: Callable[[BatchSizeTrial], None] | None = None,
    model: torch.nn.Module | None = None,
    example_input: Any = None,
    precision: str = "32-true",
    activation_checkpointing: Any = None,
) -> BatchSizeResult:
    """Largest batch size for which ``step_fn(batch_size)`` runs without running out of memory.

    ``step_fn`` should run one full training step (forward, backward, optimizer step) at the
    given batch size; it is called once per trial. Out-of-memory is recognised by the device's
    error type; any other exception propagates. Between trials the failed trial's frames are
    cleared, garbage collected and the allocator cache emptied.

    Args:
        step_fn: runs one step at a batch size.
        start: first size tried.
        max: largest size worth trying (e.g. the data set size); ``None`` for no bound other
            than memory. On the CPU, where running out of memory means the OS kills the
            process rather than an exception, the search also never runs a size predicted
            (from the resident memory of the trials before) to need more than 75% of the RAM
            available when it began; give ``max`` as well when the step's memory does not grow
            with the batch size in proportion.
        margin: fraction taken off the largest fitting size for headroom (fragmentation,
            longer sequences later): ``batch_size = floor(max_fitting * (1 - margin))``.
        tolerance: stop bisecting once ``max_fitting >= (1 - tolerance) * (smallest_failing - 1)``,
            so the result is within ``tolerance`` of the true limit.
        max_trials: hard bound on trials.
        device: device the step runs on; picks the OOM type and cache to empty.
        on_trial: called after each trial (each is also logged on ``gpukit.memory``).
        model, example_input, precision, activation_checkpointing: the model ``step_fn`` trains
            and one input batch of it (any size: dim 0 is the batch), at this precision and
            checkpointing policy. When even ``start`` does not fit, the error then names the
            fixes the planner predicts at ``start`` items, each with its saving.

    Returns:
        A :class:`BatchSizeResult`.

    Raises:
        ConfigurationError: for invalid arguments.
        MemoryPlanError: when even ``start`` runs out of memory.
    """
    _check_arguments(start, max, margin, tolerance, model, example_input)
    _positive_int("max_trials", max_trials)  # 0 ran nothing and said even the start size runs out of memory
    accelerator = get_accelerator(device if device is not None else auto_device_type())
    # the device's own counters ("cuda:1"); None is the current device of the accelerator
    target = torch.device(device) if device is not None else None
    search = _Search(step_fn, accelerator, target, on_trial, max_trials)
    # 1. double from start: the last size that ran and the first that did not bracket the limit
    lo, hi = search.double(start, max)
    if lo == 0:
        raise MemoryPlanError(_start_does_not_fit(start, accelerator, model, example_input, precision,
                                                  activation_checkpointing))
    # 2. bisect the bracket at its geometric mean until lo is within tolerance of the limit
    lo, hi = search.bisect(lo, hi, tolerance)
    chosen = lo if margin == 0 else _larger(1, math.floor(lo * (1 - margin)))
    return BatchSizeResult(chosen, lo, hi, tuple(search.trials))


def _check_arguments(start: Any, max: Any, margin: float, tolerance: float,  # noqa: A002
                     model: torch.nn.Module | None, example_input: Any) -> None:
    start = _positive_int("start", start)
    if max is not None and _positive_int("max", max) < start:
        raise ConfigurationError(f"find_batch_size(start={start}, max={max}): max must be >= start.")
    if not 0 <= margin < 1 or not 0 < tolerance < 1:
        raise ConfigurationError(f"find_batch_size(margin={margin}, tolerance={tolerance}): expected 0 <= margin < 1, 0 < tolerance < 1.")
    if (model is None) != (example_input is None):
        raise ConfigurationError(
            f"find_batch_size(model={type(model).__name__ if model is not None else None}, example_input="
            f"{type(example_input).__name__ if example_input is not None else None}): give both (the planner sizes "
            "the fixes it names from the model and one batch of its input) or neither.")


class _Search:
    """The trials of one search, at most ``max_trials``: each size runs ``step_fn`` once -- on the CPU,
    unless the RAM it is predicted to need (from the trials before) is more than the search allows."""

    def __init__(self, step_fn: Callable[[int], Any], accelerator: Accelerator, target: torch.device | None,
                 on_trial: Callable[[BatchSizeTrial], None] | None, max_trials: int) -> None:
        self.step_fn, self.accelerator, self.target = step_fn, accelerator, target
        self.on_trial, self.max_trials = on_trial, max_trials
        self.ram = HostRamBudget() if accelerator.is_host else None  # what is available as the search begins
        self.trials: list[BatchSizeTrial] = []

    @property
    def spent(self) -> bool:
        return len(self.trials) >= self.max_trials

    def double(self, start: int, most: int | None) -> tuple[int, int | None]:
        """``(largest size that ran or 0, smallest that did not or None)`` doubling from ``start``."""
        size, ran = start, 0
        while not self.spent:
            if not self.run(size):
                return ran, size
            ran = size
            if most is not None and size >= most:
                break
            size = size * 2 if most is None else min(size * 2, most)
        return ran, None

    def bisect(self, lo: int, hi: int | None, tolerance: float) -> tuple[int, int | None]:
        """Narrow ``[lo, hi - 1]``, where the limit lies, until ``lo`` is within ``tolerance`` of its top."""
        while hi is not None and lo < (1 - tolerance) * (hi - 1) and not self.spent:
            mid = min(hi - 1, _larger(int(round(math.sqrt(lo * (hi - 1)))), lo + 1))
            if self.run(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi

    def run(self, size: int) -> bool:
        """One trial at ``size``, recorded, logged and reported; whether it fitted."""
        predicted = self.ram.too_big(size) if self.ram is not None else None
        if self.ram is not None and predicted is not None:
            trial = BatchSizeTrial(size, False, 0.0, None, ram_limited=True)
            log.info("batch size %d: not run, predicted to need %s more RAM; the search allows %s "
                     "(available RAM less %d%%)", size, format_bytes(predicted), format_bytes(self.ram.budget_bytes),
                     round(RAM_HEADROOM * 100))
        else:
            def attempt() -> tuple[bool, float, int | None]:
                return _trial(self.step_fn, size, self.accelerator, self.target)

            fits = attempt() if self.ram is None else self.ram.measure(size, attempt)
            trial = BatchSizeTrial(size, fits[0], fits[1], fits[2])
            log.info("batch size %d: %s (%.2f s)", size, "fits" if trial.fits else "out of memory", trial.duration_s)
        self.trials.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial.fits


def _start_does_not_fit(start: int, accelerator: Accelerator, model: torch.nn.Module | None, example_input: Any,
                        precision: str, activation_checkpointing: Any) -> str:
    """The error when even ``start`` runs out of memory: the planner's fixes when the model is given."""
    fixes = None
    if model is not None:
        from gpukit.memory._advice import planned_fixes

        fixes = planned_fixes(model, resized(example_input, start), precision=precision, device=accelerator.type,
                              activation_checkpointing=activation_checkpointing, smaller_batch=start > 1)
    return f"find_batch_size: even the start size {start} runs out of memory. " + (fixes or (
        "Try start=1, a lower precision (bf16-mixed), activation checkpointing, or check "
        "estimate_memory(...) for what does not fit (or pass model= and example_input= for planned fixes)."))


def _larger(a: int, b: int) -> int:  # the builtin max is shadowed by the documented argument
    return a if a > b else b


def _trial(
    step_fn: Callable[[int], Any], size: int, accelerator: Accelerator, device: torch.device | None = None
) -> tuple[bool, float, int | None]:
    accelerator.reset_peak_memory_stats(device)
    started = time.perf_counter()
    fits = True
    try:
        step_fn(size)
        accelerator.synchronize(device)
    except accelerator.oom_error_types() as exc:
        traceback.clear_frames(exc.__traceback__)
        fits = False
    duration_s = time.perf_counter() - started
    if not fits:  # a failed step can leave reference cycles holding device memory
        gc.collect()
    accelerator.empty_cache()
    peak = accelerator.memory_stats(device).get("peak_allocated_bytes") if fits else None
    return fits, duration_s, peak
