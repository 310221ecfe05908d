"""The RAM a batch-size search on the CPU may use.

On a GPU, running out of memory is an exception the search catches. On the CPU it is the
operating system killing the process (or swapping it to a crawl): a search that doubles until
it fails never sees a failure. So on the host the search measures how far each trial raised
the process's resident memory, scales that to the next size (activations grow linearly with
the batch) and does not run a size predicted to pass the RAM that was available when the
search began, less a safety margin.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["HostRamBudget", "RAM_HEADROOM"]

#: fraction of the available RAM a CPU search leaves free (other processes, allocator slack)
RAM_HEADROOM = 0.25
_SAMPLE_S = 0.005


class HostRamBudget:
    """Peak resident-memory growth per batch size, and whether a larger size would still fit.

    Args:
        headroom: fraction of ``psutil.virtual_memory().available`` kept free.
        available_bytes: the RAM to budget from (default: what is available now).
    """

    def __init__(self, headroom: float = RAM_HEADROOM, available_bytes: int | None = None) -> None:
        self._process = psutil.Process(os.getpid())
        self.base_rss_bytes = self._rss()
        available = psutil.virtual_memory().available if available_bytes is None else available_bytes
        #: growth of resident memory over the search's start that the search allows
        self.budget_bytes = int(available * (1 - headroom))
        self._growth: dict[int, int] = {}  # batch size -> peak RSS over the start while it ran

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def measure(self, size: int, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` and remember its peak resident-memory growth for ``size``.

        Linux gives the exact peak (``VmHWM``, reset first through ``/proc/self/clear_refs``);
        elsewhere a thread samples the resident size every 5 ms.
        """
        exact = _reset_high_water_mark()
        peak = [self._rss()]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(_SAMPLE_S):
                peak[0] = max(peak[0], self._rss())

        sampler = None if exact else threading.Thread(target=sample, name="gpukit-ram-sampler", daemon=True)
        if sampler is not None:
            sampler.start()
        try:
            return fn()
        finally:
            done.set()
            if sampler is not None:
                sampler.join()
            high = _high_water_mark() if exact else None
            self._growth[size] = max(peak[0], self._rss(), high or 0) - self.base_rss_bytes

    def predicted_bytes(self, size: int) -> int | None:
        """Predicted peak growth at ``size``, scaled linearly from the largest measured size below it."""
        below = [s for s in self._growth if s <= size]
        if not below:
            return None
        measured = max(below)
        return int(max(0, self._growth[measured]) * size / measured)

    def too_big(self, size: int) -> int | None:
        """The predicted bytes when ``size`` would pass the budget, else ``None``."""
        predicted = self.predicted_bytes(size)
        return predicted if predicted is not None and predicted > self.budget_bytes else None


_STATUS = "/proc/self/status"


def _reset_high_water_mark() -> bool:
    """Reset this process's peak resident size (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return _high_water_mark() is not None
    except OSError:
        return False


def _high_water_mark() -> int | None:
    try:
        with open(_STATUS) as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
