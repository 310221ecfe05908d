"""Background sampling of device utilization while a run trains.

GPU utilization comes from NVML through the devices layer (the same numbers nvidia-smi
shows); on a CPU-only run the process's CPU utilization is sampled instead, so "is the
device busy?" has an answer everywhere.
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import psutil

__all__ = ["PeriodicSampler", "UtilizationSampler", "UtilizationSummary"]


@dataclass(frozen=True)
class UtilizationSummary:
    """Mean and max utilization over the sampled window.

    ``source`` is ``"nvml"`` (GPU utilization %, averaged over the sampled GPUs) or
    ``"cpu"`` (this process's CPU %, 100 per fully used core).
    """

    source: str
    samples: int
    mean_pct: float | None
    max_pct: float | None


def _gpu_reader(physical_indices: Sequence[int]) -> Callable[[], float | None]:
    from gpukit.devices import list_gpus

    wanted = set(physical_indices)

    def read() -> float | None:
        values = [
            gpu.utilization_gpu_pct
            for gpu in list_gpus()
            if gpu.index in wanted and gpu.utilization_gpu_pct is not None
        ]
        return statistics.fmean(values) if values else None

    return read


def _cpu_reader() -> Callable[[], float | None]:
    process = psutil.Process(os.getpid())
    process.cpu_percent(None)  # first call only starts the measurement window

    def read() -> float | None:
        return process.cpu_percent(None)

    return read


class PeriodicSampler:
    """Calls :meth:`sample_once` every ``interval_s`` on a daemon thread until :meth:`stop`.

    Subclasses implement ``sample_once``; it must not raise (a sampler never kills training).
    """

    def __init__(self, interval_s: float = 1.0, thread_name: str = "gpukit-sampler") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._thread_name = thread_name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def start(self) -> PeriodicSampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        # Event.wait doubles as the interval timer and the prompt exit on stop().
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
            self._thread = None


class UtilizationSampler(PeriodicSampler):
    """Samples utilization every ``interval_s`` on a daemon thread.

    Args:
        physical_gpu_indices: NVML indices of the GPUs this run uses; empty or ``None`` samples
            this process's CPU utilization instead.
        interval_s: seconds between samples.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, physical_gpu_indices: Sequence[int] | None = None, interval_s: float = 1.0) -> None:
        super().__init__(interval_s, "gpukit-utilization")
        self.source = "nvml" if physical_gpu_indices else "cpu"
        self._read = _gpu_reader(physical_gpu_indices) if physical_gpu_indices else _cpu_reader()
        self._values: list[float] = []

    def sample_once(self) -> None:
        """Take one sample now (also called by the background thread)."""
        try:
            value = self._read()
        except Exception:  # a lost GPU or a vanished process must not kill training
            value = None
        if value is not None:
            self._values.append(float(value))

    def stop(self) -> UtilizationSummary:
        self._join()
        return self.summary()

    def summary(self) -> UtilizationSummary:
        values = list(self._values)
        return UtilizationSummary(
            source=self.source,
            samples=len(values),
            mean_pct=statistics.fmean(values) if values else None,
            max_pct=max(values) if values else None,
        )

    def __enter__(self) -> UtilizationSampler:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
