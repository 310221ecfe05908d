"""Where FSDP2 lives in the installed torch: ``torch.distributed.fsdp`` (2.6+) or, in torch 2.5,
``torch.distributed._composable.fsdp`` (the same classes before they were made public).

Imported when an FSDP strategy is used, never at ``import gpukit`` (it loads torch.distributed).
"""

from __future__ import annotations

from types import SimpleNamespace

__all__ = ["fsdp_api"]

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
