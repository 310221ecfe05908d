"""Where FSDP2 lives in the installed torch: ``torch.distributed.fsdp`` (2.6+) or, in torch 2.5,
``torch.distributed._composable.fsdp`` (the same classes before they were made public).

Imported when an FSDP strategy is used, never at ``import gpukit`` (it loads torch.distributed).
"""

from __future__ import annotations

from types import SimpleNamespace

from gpukit.errors import ConfigurationError

__all__ = ["fsdp_api", "check_fsdp_device", "CPU_FSDP_MIN_TORCH"]

#: FSDP2 on CPU processes (gloo) works from this torch on; 2.5 and 2.6 need CUDA for its streams
CPU_FSDP_MIN_TORCH = (2, 7)

_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy")
_api: SimpleNamespace | None = None


def fsdp_api() -> SimpleNamespace:
    """``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ``OffloadPolicy``."""
    global _api
    if _api is None:
        try:
            import torch.distributed.fsdp as module

            missing = [n for n in _NAMES if not hasattr(module, n)]
            if missing:
                raise ImportError(missing)
        except ImportError:
            import torch.distributed._composable.fsdp as module  # torch 2.5
        _api = SimpleNamespace(**{name: getattr(module, name) for name in _NAMES})
    return _api


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def check_fsdp_device(device_type: str) -> None:
    """Refuse FSDP on CPU processes where the installed torch cannot run it.

    Raises:
        ConfigurationError: the device is the CPU and torch is older than :data:`CPU_FSDP_MIN_TORCH`
            (its FSDP2 raises "FSDP requires CUDA for streams" at the first forward).
    """
    if device_type != "cpu" or _torch_version() >= CPU_FSDP_MIN_TORCH:
        return
    import torch

    need = ".".join(map(str, CPU_FSDP_MIN_TORCH))
    raise ConfigurationError(
        f"strategy='fsdp' on CPU processes needs torch >= {need}; this is torch {torch.__version__}, "
        "whose FSDP2 runs on CUDA only. Use strategy='ddp' on the CPU, run FSDP on GPUs, or "
        f"upgrade torch (pip install 'torch>={need}')."
    )
