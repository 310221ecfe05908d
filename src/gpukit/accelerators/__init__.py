"""Accelerators: the one place that branches on backend names ("cuda", "mps", "cpu").

Everything else receives an :class:`Accelerator` object and calls its methods. Base methods do
the CPU thing (or nothing), so each backend overrides only what differs: ``_base`` (the interface,
the CPU), ``_backends`` (CUDA, MPS), ``_fake`` (CUDA's behaviour on the CPU, for tests), ``_counts``
(the syncs and device events gpukit asked for), ``_select`` (an accelerator by device type).
"""

from __future__ import annotations

from gpukit.accelerators._backends import CUDAAccelerator, MPSAccelerator
from gpukit.accelerators._base import Accelerator, CPUAccelerator, KernelWindow, SpeedTraits
from gpukit.accelerators._counts import SYNC_COUNTS, SyncCounts
from gpukit.accelerators._fake import FakeCUDAAccelerator
from gpukit.accelerators._select import DEVICE_TYPES, auto_device_type, get_accelerator

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "FakeCUDAAccelerator",
    "SYNC_COUNTS",
    "SyncCounts",
    "MPSAccelerator",
    "get_accelerator",
    "auto_device_type",
    "DEVICE_TYPES",
    "KernelWindow",
    "SpeedTraits",
]
