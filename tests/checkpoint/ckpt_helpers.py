"""Helpers shared by the checkpoint tests and their worker scripts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.serialization as serialization
from torch import nn

__all__ = ["SmallNet", "save_with_cuda_location"]


class SmallNet(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def save_with_cuda_location(obj: Any, path: Path) -> None:
    """Write a torch file whose storages claim device ``cuda:0``, on a machine without CUDA.

    No CUDA tensor can exist here, so we use torch's public hook for device tags:
    ``torch.serialization.register_package`` adds a tagger that torch.save asks (first, by
    priority) for each storage's location string; ours answers "cuda:0". The file is then what
    torch.save writes for CUDA tensors (location "cuda:0" in data.pkl), and plain ``torch.load``
    on a CPU-only machine fails with torch's real "Attempting to deserialize object on a CUDA
    device" error. The hook is removed from torch's registry before returning.
    """

    def tagger(storage: Any) -> str:
        return "cuda:0"

    def deserializer(storage: Any, location: str) -> None:
        return None  # never handles a load: loading goes through torch's own CUDA path

    serialization.register_package(-100, tagger, deserializer)
    try:
        torch.save(obj, path)
    finally:
        serialization._package_registry[:] = [
            entry for entry in serialization._package_registry if entry[1] is not tagger
        ]
