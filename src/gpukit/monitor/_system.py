"""System figures of one rank, sampled on a background thread (never in the training loop).

Each sample holds what the monitor and memory layers already measure: GPU utilization and
NVML memory of this rank's GPU (``devices``), torch's allocator counters
(``Accelerator.memory_stats``), this process's CPU utilization (the utilization sampler's
reader) and host memory (psutil). Missing figures are ``None`` (no GPU, no driver).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import psutil

from gpukit.monitor._utilization import PeriodicSampler, _cpu_reader

if TYPE_CHECKING:
    import torch

    from gpukit.accelerators import Accelerator

__all__ = ["SystemSampler", "read_system"]


def read_system(accelerator: Accelerator | None, device: torch.device | None, cpu_pct: Callable[[], float | None]) -> dict[str, Any]:
    """One sample of this rank's device, process and host, as record fields (units in names)."""
    sample: dict[str, Any] = {}
    if accelerator is not None and device is not None:
        snapshot = accelerator.gpu_snapshot(device)  # NVML's view, where NVML describes the device
        sample["gpu_util_pct"] = getattr(snapshot, "utilization_gpu_pct", None)
        sample["gpu_mem_used_bytes"] = getattr(snapshot, "memory_used_bytes", None)
        sample["gpu_mem_total_bytes"] = getattr(snapshot, "memory_total_bytes", None)
        stats = accelerator.memory_stats(device)
        sample["torch_allocated_bytes"] = stats.get("allocated_bytes")
        sample["torch_reserved_bytes"] = stats.get("reserved_bytes")
    sample["process_rss_bytes"] = psutil.Process().memory_info().rss
    sample["cpu_pct"] = cpu_pct()
    host = psutil.virtual_memory()
    sample["host_mem_used_bytes"], sample["host_mem_total_bytes"] = host.used, host.total
    return {k: v for k, v in sample.items() if v is not None}


class SystemSampler(PeriodicSampler):
    """Calls ``on_sample(fields)`` with :func:`read_system` every ``interval_s`` on a daemon thread.

    Args:
        accelerator: the session's accelerator (its memory counters), or ``None``.
        device: this rank's device, or ``None`` (process and host figures only).
        on_sample: receives each sample's fields; called on the sampler thread.
        interval_s: seconds between samples (> 0).
    """

    def __init__(self, accelerator: Accelerator | None, device: torch.device | None,
                 on_sample: Callable[[dict[str, Any]], None], interval_s: float = 1.0) -> None:
        super().__init__(interval_s, "gpukit-record-sampler")
        self._accelerator = accelerator
        self._device = device
        self._on_sample = on_sample
        self._cpu = _cpu_reader()

    def sample_once(self) -> None:
        """Take one sample now (the thread calls this every interval)."""
        try:
            fields = read_system(self._accelerator, self._device, self._cpu)
        except Exception:  # noqa: BLE001 - a lost GPU or driver hiccup must not kill training
            return
        self._on_sample(fields)

    def start(self) -> SystemSampler:
        super().start()
        return self

    def stop(self) -> None:
        self._join()
