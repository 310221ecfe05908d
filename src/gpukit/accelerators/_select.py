"""The accelerator of a device or device type, and the best device type this process can use."""

from __future__ import annotations

import torch

from gpukit.accelerators._backends import CUDAAccelerator, MPSAccelerator
from gpukit.accelerators._base import Accelerator, CPUAccelerator
from gpukit.errors import ConfigurationError

__all__ = ["DEVICE_TYPES", "auto_device_type", "get_accelerator"]

DEVICE_TYPES = ("cpu", "cuda", "mps")

_BY_TYPE: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "mps": MPSAccelerator,
}


def get_accelerator(device: torch.device | str) -> Accelerator:
    """The accelerator for a device or device-type string (``"cuda:1"`` -> CUDA).

    Raises:
        ConfigurationError: for a device type gpukit does not support.
    """
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    cls = _BY_TYPE.get(device_type)
    if cls is None:
        raise ConfigurationError(
            f"Unsupported device type {device_type!r}; gpukit supports {', '.join(DEVICE_TYPES)}."
        )
    return cls()


def auto_device_type() -> str:
    """The best device type this process can use: "cuda", then "mps", then "cpu"."""
    for device_type in ("cuda", "mps"):
        if _BY_TYPE[device_type]().is_available():
            return device_type
    return "cpu"
