"""A strategy added the way docs/architecture.md says: one file (this one) plus one registry line
(in tests/test_layout.py). It runs like "single" and counts the modules it set up."""

from __future__ import annotations

from torch import nn

from gpukit.strategies import SingleDeviceStrategy


class ToyStrategy(SingleDeviceStrategy):
    name = "toy"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.modules_set_up = 0

    def setup_module(self, module: nn.Module) -> nn.Module:
        self.modules_set_up += 1
        return super().setup_module(module)
