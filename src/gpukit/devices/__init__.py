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
# `gpukit ls` loads only the modules it needs and starts fast. __all__ is this table's keys;
# the TYPE_CHECKING imports below repeat it for type checkers (tests/test_architecture.py checks they agree).
_LAZY: dict[str, str] = {
    "GpuSnapshot": "_snapshot", "GpuProcess": "_snapshot", "list_gpus": "_snapshot",
    "selectable_units": "_snapshot",
    "select_gpus": "_select", "ORDERS": "_criteria",
    "claim_gpus": "_claims", "GpuClaim": "_claims",
    "claim_holders": "_claim_files", "claim_owners": "_claim_files",
    "CLAIM_DIR_ENV": "_claim_dir", "SYSTEM_CLAIM_DIR": "_claim_dir", "default_claim_dir": "_claim_dir",
    "open_claim_folder": "_claim_dir",
    "ClaimState": "_claims_admin", "read_claim_state": "_claims_admin", "setup_folder": "_claims_admin",
    "clean_folder": "_claims_clean", "kernel_problem": "_claims_admin",
    "use_gpus": "_env", "cuda_initialized": "_env",
    "parse_visible_devices": "_visible", "resolve_visible": "_visible", "VisibleEntry": "_visible",
    "logical_to_physical": "_visible", "describe_mapping": "_visible", "explain_visible": "_visible",
    "order_may_differ": "_visible", "VISIBLE_DEVICES_ENV": "_visible",
    "FakeNvml": "_fake", "FakeSpec": "_spec",
    "FAKE_ENV": "_nvml", "driver_version": "_nvml", "unavailable_reason": "_nvml",
    "is_fake_backend": "_nvml", "silence_notice": "_nvml",
    "GpuHealth": "_health", "gpu_health": "_health", "persistence_mode": "_health",
    "DensePeak": "_peaks", "dense_peak": "_peaks", "memory_bandwidth_gbps": "_peaks", "peak_table": "_peaks", "PEAK_DTYPES": "_peaks",
}

__all__ = [*_LAZY]


__getattr__, __dir__ = lazy_exports(
    __name__, globals(), {name: f"gpukit.devices.{module}" for name, module in _LAZY.items()}
)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from gpukit.devices._claim_dir import CLAIM_DIR_ENV, SYSTEM_CLAIM_DIR, default_claim_dir, open_claim_folder
    from gpukit.devices._claim_files import claim_holders, claim_owners
    from gpukit.devices._claims_admin import ClaimState, kernel_problem, read_claim_state, setup_folder
    from gpukit.devices._claims_clean import clean_folder
    from gpukit.devices._claims import GpuClaim, claim_gpus
    from gpukit.devices._env import cuda_initialized, use_gpus
    from gpukit.devices._fake import FakeNvml
    from gpukit.devices._health import GpuHealth, gpu_health, persistence_mode
    from gpukit.devices._nvml import FAKE_ENV, driver_version, is_fake_backend, silence_notice, unavailable_reason
    from gpukit.devices._criteria import ORDERS
    from gpukit.devices._peaks import PEAK_DTYPES, DensePeak, dense_peak, memory_bandwidth_gbps, peak_table
    from gpukit.devices._select import select_gpus
    from gpukit.devices._snapshot import GpuProcess, GpuSnapshot, list_gpus, selectable_units
    from gpukit.devices._spec import FakeSpec
    from gpukit.devices._visible import (
        VISIBLE_DEVICES_ENV, VisibleEntry, describe_mapping, explain_visible, logical_to_physical, order_may_differ,
        parse_visible_devices, resolve_visible,
    )
