"""Bandwidths an inference plan's tokens/s bound is made of: device memory (the data sheet, through
``gpukit.devices``), host memory and disk reads (measured here, briefly), host-to-GPU copies
(stated: PCIe 4.0 x16's effective rate unless measured)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

__all__ = ["HOST_PROBE_BYTES", "HOST_TO_GPU_BYTES_PER_S", "gpu_memory_bandwidth", "host_memory_bandwidth",
           "host_probe_pending", "read_bandwidth"]

#: pinned host -> GPU copies over PCIe 4.0 x16, effective (an assumption the plan states)
HOST_TO_GPU_BYTES_PER_S = 25e9
#: the host-bandwidth probe's one buffer: as large as a server's last-level cache (32 MiB on this
#: project's EPYC) so the reads come mostly from DRAM; it is held only while the probe runs, before any
#: weight is read, and a plan that runs the probe counts it in the host's peak
HOST_PROBE_BYTES = 32 * 2**20
_host_cache: list[float] = []


def gpu_memory_bandwidth(index: int) -> float | None:
    """Data-sheet memory bandwidth of visible GPU ``index`` in bytes/s; ``None``: not in the table."""
    from gpukit.devices import list_gpus, memory_bandwidth_gbps, resolve_visible, silence_notice

    silence_notice()
    visible = resolve_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), list_gpus())
    if index >= len(visible):
        return None
    gbps = memory_bandwidth_gbps(visible[index].name)
    return None if gbps is None else gbps * 1e9


def host_probe_pending() -> bool:
    """Whether the next ``host_memory_bandwidth()`` call runs the probe (it runs once per process)."""
    return not _host_cache


def host_memory_bandwidth() -> float:
    """Bytes/s the host reads from memory (a sum over one filled ``HOST_PROBE_BYTES`` buffer, best of
    three; measured once per process, the buffer freed before it returns).

    A forward on the CPU reads every weight once per token: this is its ceiling. One buffer read,
    not a copy between two: a decode step reads weights, and the probe holds half the memory."""
    if not _host_cache:
        buffer = torch.ones(HOST_PROBE_BYTES // 4, dtype=torch.float32)  # filled: its pages are real, not zero pages
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        del buffer
        _host_cache.append(HOST_PROBE_BYTES / max(best, 1e-9))
    return _host_cache[0]


def read_bandwidth(path: str | os.PathLike[str], limit_bytes: int = 256 * 2**20) -> float | None:
    """Bytes/s reading ``path`` from disk (at most ``limit_bytes``), its pages first dropped from the
    page cache where the OS allows it (``posix_fadvise``); ``None`` when nothing could be read."""
    source = Path(path)
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = min(os.fstat(fd).st_size, limit_bytes)
        if size <= 0:
            return None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(min(size, 4 * 2**20))
        view, done = memoryview(buffer), 0
        start = time.perf_counter()
        while done < size:
            got = os.preadv(fd, [view[: min(len(buffer), size - done)]], done)
            if got <= 0:
                break
            done += got
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
    return done / max(elapsed, 1e-9) if done else None
