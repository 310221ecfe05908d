"""gpukit.placement: resolve_device, to_device, unwrap_model."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gpukit
from gpukit import placement
from gpukit.accelerators import CPUAccelerator, CUDAAccelerator
from gpukit.errors import ConfigurationError, DeviceError
from gpukit.placement import resolve_device, to_device, unwrap_model

META = torch.device("meta")  # a real second device on a CPU-only box


def test_top_level_reexports() -> None:
    assert gpukit.resolve_device is resolve_device and gpukit.unwrap_model is unwrap_model


@pytest.mark.parametrize("spec", ["cpu", "CPU", torch.device("cpu"), "cpu:0"])
def test_resolve_cpu_forms(spec: object) -> None:
    assert resolve_device(spec) == torch.device("cpu")


def test_auto_is_cpu_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "auto_device_type", lambda: "cpu")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", 1.5, True, -1, "xla"])
def test_unknown_specs_list_the_allowed_forms(spec: object) -> None:
    with pytest.raises(ConfigurationError, match='"auto", "cpu", "cuda"'):
        resolve_device(spec)  # type: ignore[arg-type]


def test_cuda_without_gpus_is_a_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: False)
    with pytest.raises(DeviceError, match="no cuda device is available"):
        resolve_device("cuda:0")


def _two_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 2)


def test_index_past_visible_gpus_shows_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_visible_gpus(monkeypatch)
    fake = types.ModuleType("gpukit.devices")
    fake.describe_mapping = lambda env=None: "cuda:0 -> GPU 2 Fake A100\ncuda:1 -> GPU 3 Fake A100"
    monkeypatch.setitem(sys.modules, "gpukit.devices", fake)
    with pytest.raises(DeviceError) as info:
        resolve_device("cuda:3")
    message = str(info.value)
    assert "only 2 cuda device(s) are visible" in message and "cuda:0..cuda:1" in message
    assert "cuda:1 -> GPU 3 Fake A100" in message and "CUDA_VISIBLE_DEVICES" in message
    assert resolve_device(1) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_index_error_survives_a_broken_devices_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_visible_gpus(monkeypatch)
    fake = types.ModuleType("gpukit.devices")

    def broken(env: object = None) -> str:
        raise RuntimeError("NVML: driver not loaded")

    fake.describe_mapping = broken
    monkeypatch.setitem(sys.modules, "gpukit.devices", fake)
    with pytest.raises(DeviceError, match="only 2 cuda device"):
        resolve_device(5)


Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass(frozen=True)
class Batch:
    images: torch.Tensor
    label: str
    extra: torch.Tensor = dataclasses.field(init=False, default_factory=lambda: torch.zeros(1))


class HasTo:
    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> HasTo:
        self.moved_to = device
        return self


def test_to_device_moves_nested_structures_and_leaves_the_rest() -> None:
    custom = HasTo()
    batch = {
        "a": torch.ones(2),
        "pair": Pair(torch.ones(1), [torch.ones(1), 3, "s"]),
        "ordered": OrderedDict(t=torch.ones(1)),
        "dc": Batch(torch.ones(2), "cat"),
        "tuple": (torch.ones(1), None),
        "custom": custom,
        "n": 7,
    }
    out = to_device(batch, META)
    assert out["a"].device == META
    assert isinstance(out["pair"], Pair) and out["pair"].x.device == META
    assert out["pair"].y[0].device == META and out["pair"].y[1:] == [3, "s"]
    assert isinstance(out["ordered"], OrderedDict) and out["ordered"]["t"].device == META
    assert isinstance(out["dc"], Batch) and out["dc"].images.device == META
    assert out["dc"].extra.device == META and out["dc"].label == "cat"
    assert out["tuple"][0].device == META and out["tuple"][1] is None
    assert custom.moved_to == META and out["n"] == 7
    assert batch["a"].device.type == "cpu"  # the input is not modified


def test_to_device_moves_modules_in_place() -> None:
    model = nn.Linear(2, 2)
    assert to_device(model, META) is model and model.weight.device == META


def test_to_device_copies_pinned_tensors_non_blocking_to_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, device, non_blocking=False: calls.append(non_blocking) or self
    )
    monkeypatch.setattr(placement, "get_accelerator", lambda device: CUDAAccelerator())
    to_device([torch.ones(1)], META)
    monkeypatch.setattr(placement, "get_accelerator", lambda device: CPUAccelerator())
    to_device([torch.ones(1)], META)
    assert calls == [True, False]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile import noise
def test_unwrap_model_strips_any_nesting() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap_model(inner) is inner
    assert unwrap_model(nn.DataParallel(inner)) is inner
    assert unwrap_model(torch.compile(nn.DataParallel(inner))) is inner
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(inner)
        assert unwrap_model(torch.compile(ddp)) is inner
        assert unwrap_model(nn.DataParallel(torch.compile(inner))) is inner
    finally:
        dist.destroy_process_group()


@pytest.mark.requires_gpu
def test_pinned_batch_arrives_on_gpu_intact() -> None:
    host = torch.arange(1000.0).pin_memory()
    out = to_device({"x": host}, "cuda")
    torch.cuda.synchronize()
    assert out["x"].device.type == "cuda" and torch.equal(out["x"].cpu(), host)
