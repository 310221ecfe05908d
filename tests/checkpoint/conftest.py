"""Fixtures for checkpoint tests: small models and checkpoints that claim GPU devices."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_helpers import SmallNet, save_with_cuda_location


@pytest.fixture
def small_net() -> SmallNet:
    torch.manual_seed(0)
    return SmallNet()


@pytest.fixture
def save_as_cuda() -> Callable[[Any, Path], None]:
    """``save_as_cuda(obj, path)``: a torch file whose storages claim ``cuda:0`` (see ckpt_helpers)."""
    return save_with_cuda_location
