"""Samples-per-second measured over wall time, excluding warm-up steps."""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Throughput"]


class Throughput:
    """Counts samples and steps against wall time.

    The first ``warmup_steps`` steps are excluded: they include one-off costs (allocator
    growth, cudnn autotuning, worker start-up) that would understate steady-state speed.

    Args:
        warmup_steps: steps to ignore before the clock starts.
        clock: a monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, warmup_steps: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self._clock = clock
        self._steps_seen = 0
        self._start_s: float | None = None if warmup_steps else clock()
        self.samples = 0
        self.steps = 0

    def update(self, samples: int) -> None:
        """Record one finished step of ``samples`` samples."""
        self._steps_seen += 1
        if self._steps_seen <= self.warmup_steps:
            if self._steps_seen == self.warmup_steps:
                self._start_s = self._clock()
            return
        self.samples += samples
        self.steps += 1

    @property
    def elapsed_s(self) -> float | None:
        return None if self._start_s is None else self._clock() - self._start_s

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second since warm-up ended; ``None`` before any timed step."""
        return self._rate(self.samples)

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second since warm-up ended; ``None`` before any timed step."""
        return self._rate(self.steps)

    def _rate(self, count: int) -> float | None:
        elapsed = self.elapsed_s
        if not self.steps or not elapsed:
            return None
        return count / elapsed
