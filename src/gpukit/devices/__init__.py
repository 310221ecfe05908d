"""Devices: see, select and claim NVIDIA GPUs. Never imports torch, never initialises CUDA.

Everything reads NVML through one module (:mod:`gpukit.devices._nvml`), from the real driver via
nvidia-ml-py, or from a :class:`FakeNvml` (in-process, or ``GPUKIT_FAKE_GPUS=spec.json`` for the
whole library and CLI). A machine without the NVIDIA driver is normal: :func:`list_gpus` returns
``[]`` and says why once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpukit._util.lazy import lazy_exports

# public name -> private module that holds it. Resolved on first use (PEP 562), so that
# `gpukit ls` loads only the modules it needs and starts fast.
_LAZY: dict[str, str] = {
    "GpuSnapshot": "_snapshot", "GpuProcess": "_snapshot", "list_gpus": "_snapshot",
    "selectable_units": "_snapshot",
    "select_gpus": "_select", "ORDERS": "_select",
    "claim_gpus": "_claims", "GpuClaim": "_claims",
    "claim_holders": "_claim_files", "claim_owners": "_claim_files", "default_claim_dir": "_claim_files",
    "CLAIM_DIR_ENV": "_claim_files",
    "use_gpus": "_env", "cuda_initialized": "_env",
    "parse_visible_devices": "_visible", "resolve_visible": "_visible", "VisibleEntry": "_visible",
    "logical_to_physical": "_visible", "describe_mapping": "_visible",
    "FakeNvml": "_fake", "FakeSpec": "_spec",
    "FAKE_ENV": "_nvml", "driver_version": "_nvml", "unavailable_reason": "_nvml",
}

__all__ = [
    "GpuSnapshot",
    "GpuProcess",
    "list_gpus",
    "selectable_units",
    "select_gpus",
    "ORDERS",
    "claim_gpus",
    "claim_holders",
    "claim_owners",
    "GpuClaim",
    "default_claim_dir",
    "CLAIM_DIR_ENV",
    "use_gpus",
    "cuda_initialized",
    "parse_visible_devices",
    "resolve_visible",
    "VisibleEntry",
    "logical_to_physical",
    "describe_mapping",
    "FakeNvml",
    "FakeSpec",
    "FAKE_ENV",
    "driver_version",
    "unavailable_reason",
]


__getattr__, __dir__ = lazy_exports(
    __name__, globals(), {name: f"gpukit.devices.{module}" for name, module in _LAZY.items()}
)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from gpukit.devices._claim_files import CLAIM_DIR_ENV, claim_holders, claim_owners, default_claim_dir
    from gpukit.devices._claims import GpuClaim, claim_gpus
    from gpukit.devices._env import cuda_initialized, use_gpus
    from gpukit.devices._fake import FakeNvml
    from gpukit.devices._nvml import FAKE_ENV, driver_version, unavailable_reason
    from gpukit.devices._select import ORDERS, select_gpus
    from gpukit.devices._snapshot import GpuProcess, GpuSnapshot, list_gpus, selectable_units
    from gpukit.devices._spec import FakeSpec
    from gpukit.devices._visible import (
        VisibleEntry, describe_mapping, logical_to_physical, parse_visible_devices, resolve_visible,
    )
