"""Give cached memory back between phases (training -> evaluation -> export)."""

from __future__ import annotations

import gc

import torch

from gpukit.accelerators import auto_device_type, get_accelerator

__all__ = ["free_memory"]


def free_memory(device: str | torch.device | None = None) -> int | None:
    """Collect garbage, then return the allocator's cached, unused blocks to the driver.

    Use it between phases, after ``del``-ing what the last phase no longer needs; calling it
    every step only makes the allocator ask the driver again (slow). It cannot free memory a
    live tensor still uses.

    Args:
        device: the device whose cache to empty (the best available type by default).

    Returns:
        Bytes of reserved memory given back, or ``None`` where the device has no allocator
        counters (the CPU).
    """
    accelerator = get_accelerator(device if device is not None else auto_device_type())
    target = torch.device(device) if device is not None else None
    before = accelerator.memory_stats(target).get("reserved_bytes")
    gc.collect()
    accelerator.empty_cache()
    after = accelerator.memory_stats(target).get("reserved_bytes")
    return None if before is None or after is None else max(0, before - after)
