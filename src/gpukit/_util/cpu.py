"""CPUs this process may use, and the DataLoader worker count gpukit derives from them (no torch)."""

from __future__ import annotations

import os

__all__ = ["MAX_AUTO_WORKERS", "usable_cpu_count", "auto_worker_count"]

MAX_AUTO_WORKERS = 8


def usable_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def auto_worker_count(usable_cpus: int, local_world_size: int) -> int:
    """``usable CPUs // processes on this node - 1`` (a core left for each training loop), in 0..8."""
    per_process = usable_cpus // max(1, local_world_size)
    return max(0, min(MAX_AUTO_WORKERS, per_process - 1))
