"""Doctor tests: no stray GPU/network environment, an isolated claim dir, a fresh NVML state.

``isolated_nvml`` and ``use_spec`` (point GPUKIT_FAKE_GPUS at a spec) live in tests/conftest.py.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from gpukit.devices import _nvml
from gpukit.doctor import DoctorContext
from gpukit.doctor._context import TorchBuild

_CLEARED = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "GPUKIT_SHM_PATH",
            "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _isolated(isolated_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_nvml, "_notice_given", True)  # no "no driver" warning in every test's output


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
