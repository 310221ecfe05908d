"""One process on one device: the base behaviour, named."""

from __future__ import annotations

from gpukit.strategies.base import Strategy

__all__ = ["SingleDeviceStrategy"]


class SingleDeviceStrategy(Strategy):
    """Train on one device (a GPU, MPS or the CPU) in this process."""

    name = "single"
