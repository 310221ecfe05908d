"""Doctor tests: no stray GPU/network environment, an isolated claim dir, a fresh NVML state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from gpukit.devices import _nvml
from gpukit.doctor import DoctorContext
from gpukit.doctor._context import TorchBuild

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"
_CLEARED = ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT",
            "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GPUKIT_SHM_PATH", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    _nvml.shutdown()
    _nvml.set_backend_override(None)
    monkeypatch.setattr(_nvml, "_notice_given", True)
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


@pytest.fixture
def make_ctx() -> Callable[..., DoctorContext]:
    """A DoctorContext read from the (fake) machine, with chosen env / torch build / CUDA state."""

    def make(env: dict[str, str] | None = None, *, torch_cuda: str | None = "12.4", torch_version: str = "2.5.1",
             cuda_uuids: list[str] | None = None, from_cli: bool = False, **kw: Any) -> DoctorContext:
        ctx = DoctorContext.gather(env=env or {}, from_cli=from_cli, **kw)
        ctx.torch = TorchBuild(torch_version, torch_cuda, False)
        ctx.cuda_uuids = lambda: cuda_uuids
        return ctx

    return make
