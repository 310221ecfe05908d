"""Fixtures for the devices tests: an isolated claim dir, no stray GPU env, a fresh NVML state.

``isolated_nvml`` and ``use_spec`` (point GPUKIT_FAKE_GPUS at a spec) live in tests/conftest.py.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_devices(isolated_nvml: None) -> None:
    return None
