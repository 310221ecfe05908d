"""/dev/shm against what DataLoader workers need (the container "bus error").

DataLoader workers hand every batch to the training process through shared memory. Docker
gives a container 64 MiB of ``/dev/shm`` unless told otherwise; a worker that cannot grow its
segment dies with "Bus error" or "unable to write to file </torch_...>: No space left on
device". Each worker keeps ``prefetch_factor`` (2) batches in flight.
"""

from __future__ import annotations

import os
import stat as stat_module

from gpukit._util.cpu import auto_worker_count, usable_cpu_count
from gpukit._util.units import format_bytes
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["check_shm", "shm_needed_bytes", "TYPICAL_BATCH_BYTES"]

#: one batch of 64 ImageNet-size images in float32 (64 x 3 x 224 x 224 x 4 bytes, ~37 MiB)
TYPICAL_BATCH_BYTES = 64 * 3 * 224 * 224 * 4
_PREFETCH_FACTOR = 2  # torch.utils.data.DataLoader's default
_FIX = ("start the container with --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir "
        "with medium: Memory at /dev/shm")


def shm_needed_bytes(workers: int, batch_bytes: int = TYPICAL_BATCH_BYTES) -> int:
    """Shared memory ``workers`` DataLoader workers keep in flight: workers x prefetch (2) x batch."""
    return max(1, workers) * _PREFETCH_FACTOR * batch_bytes


def check_shm(ctx: DoctorContext) -> list[Finding]:
    """Size and free space of the shared-memory filesystem (``ctx.shm_path``, default ``/dev/shm``)."""
    name = "system.shm"
    path = ctx.shm_path
    given = ctx.shm_source != "default"
    try:
        kind = os.stat(path).st_mode
        if not stat_module.S_ISDIR(kind):  # statvfs of a file measures the filesystem it lies on
            what = "a FIFO" if stat_module.S_ISFIFO(kind) else "a regular file" if stat_module.S_ISREG(kind) else \
                "a device or socket"
            return [Finding(name, "fail", f"{path} ({ctx.shm_source}) is {what}, not the shared-memory "
                            "directory DataLoader workers write to",
                            f"point {ctx.shm_source} at the shared-memory mount (usually /dev/shm)",
                            {"path": path, "source": ctx.shm_source})]
        stat = os.statvfs(path)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        if given:  # a path someone chose that cannot be measured is their mistake, not the container's
            return [Finding(name, "fail", f"cannot measure {path} ({ctx.shm_source}): {exc.strerror or exc}",
                            f"point {ctx.shm_source} at the shared-memory mount (usually /dev/shm)",
                            {"path": path, "source": ctx.shm_source})]
        return [Finding(name, "warn" if missing and os.name == "posix" else "info",
                        f"cannot measure {path}: {exc.strerror or exc}; DataLoader workers need shared memory",
                        _FIX if missing and os.name == "posix" else None, {"path": path})]
    total = stat.f_blocks * stat.f_frsize
    free = stat.f_bavail * stat.f_frsize
    workers = auto_worker_count(usable_cpu_count(), 1)
    needed = shm_needed_bytes(workers)
    details = {"path": path, "total_bytes": total, "free_bytes": free, "needed_bytes": needed,
               "workers": workers}
    sizes = f"{path} is {format_bytes(total)} ({format_bytes(free)} free)"
    need = (f"{max(1, workers)} DataLoader worker(s) x {_PREFETCH_FACTOR} batches of "
            f"~{format_bytes(TYPICAL_BATCH_BYTES)} "
            f"need ~{format_bytes(needed)}")
    if total < needed:
        return [Finding(name, "fail", f"{sizes}; {need}: workers will die with \"Bus error\"", _FIX, details)]
    if free < needed:
        return [Finding(name, "warn", f"{sizes}; {need}, and only {format_bytes(free)} is free "
                        "(segments left by killed runs?)",
                        f"remove stale files (ls -la {path}; files named torch_* belong to dead runs) or {_FIX}",
                        details)]
    return [Finding(name, "ok", f"{sizes}; {need}", None, details)]
