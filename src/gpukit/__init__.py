"""gpukit: make PyTorch use GPUs well.

The top level re-exports a small curated API. Names are resolved lazily (PEP 562) so that
``import gpukit`` -- and therefore ``gpukit ls`` -- never imports torch or initialises CUDA;
torch is imported the first time a torch-backed name (``Session``, ``save``...) is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpukit._util.lazy import lazy_exports
from gpukit._util.version import __version__
from gpukit.errors import (
    CheckpointError,
    ConfigurationError,
    DeviceError,
    GpukitError,
    GpuSelectionError,
)

# public name -> module that owns it
_LAZY: dict[str, str] = {
    # devices (no torch)
    "list_gpus": "gpukit.devices",
    "select_gpus": "gpukit.devices",
    "use_gpus": "gpukit.devices",
    "claim_gpus": "gpukit.devices",
    "FakeNvml": "gpukit.devices",
    # placement / precision / session
    "resolve_device": "gpukit.placement",
    "to_device": "gpukit.placement",
    "unwrap_model": "gpukit.placement",
    "Session": "gpukit.session",
    # checkpoints
    "save": "gpukit.checkpoint",
    "load": "gpukit.checkpoint",
    "load_state_dict": "gpukit.checkpoint",
    "CheckpointManager": "gpukit.checkpoint",
    # memory
    "memory_report": "gpukit.memory",
    "show_utilization": "gpukit.memory",
    "find_batch_size": "gpukit.memory",
    "estimate_memory": "gpukit.memory",
    # big-model inference
    "load_for_inference": "gpukit.inference",
}

__all__ = [
    "__version__",
    "GpukitError",
    "ConfigurationError",
    "DeviceError",
    "GpuSelectionError",
    "CheckpointError",
    *_LAZY,
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from gpukit.checkpoint import CheckpointManager, load, load_state_dict, save
    from gpukit.devices import FakeNvml, claim_gpus, list_gpus, select_gpus, use_gpus
    from gpukit.inference import load_for_inference
    from gpukit.memory import estimate_memory, find_batch_size, memory_report, show_utilization
    from gpukit.placement import resolve_device, to_device, unwrap_model
    from gpukit.session import Session
