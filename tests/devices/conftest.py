"""Fixtures for the devices tests: an isolated claim dir, no stray GPU env, a fresh NVML state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from gpukit.devices import _nvml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


@pytest.fixture(autouse=True)
def _isolated_devices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    _nvml.shutdown()
    _nvml.set_backend_override(None)
    monkeypatch.setattr(_nvml, "_notice_given", False)
    yield
    _nvml.set_backend_override(None)
    _nvml.shutdown()


@pytest.fixture
def use_spec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[Any], Path]:
    """Point GPUKIT_FAKE_GPUS at a spec: an example name ("shared-4gpu") or a dict written to a file."""

    def use(spec: Any) -> Path:
        if isinstance(spec, str):
            path = EXAMPLES / f"{spec}.json"
        else:
            path = tmp_path / f"spec-{abs(hash(json.dumps(spec, sort_keys=True)))}.json"
            path.write_text(json.dumps(spec))
        monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(path))
        return path

    return use

