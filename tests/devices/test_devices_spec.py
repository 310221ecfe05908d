"""Fake-GPU specs are validated with clear errors, and FakeNvml behaves like pynvml, failures included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpukit.devices import FakeNvml
from gpukit.devices._spec import load_spec, parse_spec
from gpukit.errors import ConfigurationError, FakeSpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


def _gpu(**extra: Any) -> dict[str, Any]:
    return {"name": "Fake GPU", "memory_total_mib": 16000, "memory_used_mib": 0, **extra}


def test_missing_file_names_the_path_and_the_variable(tmp_path: Path) -> None:
    with pytest.raises(FakeSpecError, match=r"nope\.json.*does not exist.*GPUKIT_FAKE_GPUS"):
        load_spec(tmp_path / "nope.json")


def test_bad_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"gpus": [\n  {"name": "x",\n   "memory_total_mib": 10,,}\n]}')
    with pytest.raises(FakeSpecError, match=r"not valid JSON: .* line 3, column \d+"):
        load_spec(path)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ([1, 2], r"must be a JSON object"),
        ({}, r"'gpus' is missing"),
        ({"gpus": {"name": "x"}}, r"'gpus' must be a list"),
        ({"gpus": [{"memory_total_mib": 1, "memory_used_mib": 0}]}, r"'gpus\[0\]\.name' is required"),
        ({"gpus": [{"name": "x", "memory_used_mib": 0}]}, r"'gpus\[0\]\.memory_total_mib' is required"),
        ({"gpus": [_gpu(memory_total_mib="12GB")]}, r"memory_total_mib' must be a number, got '12GB' \(str\)"),
        ({"gpus": [_gpu(lost="yes")]}, r"'gpus\[0\]\.lost' must be true or false"),
        ({"gpus": [_gpu(temperature_c=True)]}, r"temperature_c' must be an integer, got True"),
        ({"gpus": [_gpu(memory_used_mib=20000)]}, r"memory_used_mib' is 20000 MiB, more than memory_total_mib 16000"),
        ({"gpus": [_gpu(utilization_gpu_pct=140)]}, r"between 0 and 100, got 140"),
        ({"gpus": [_gpu(memory_totl_mib=1)]}, r"unknown key\(s\) 'memory_totl_mib'; allowed: .*memory_total_mib"),
        ({"gpus": [_gpu(compute_mode="Shared")]}, r"must be one of Default, Exclusive_Thread, Prohibited"),
        ({"gpus": [_gpu(uuid="1234")]}, r"must start with 'GPU-'"),
        ({"gpus": [_gpu(uuid="GPU-a"), _gpu(uuid="GPU-a")]}, r"'gpus\[1\]\.uuid' 'GPU-a' is already used by gpus\[0\]"),
        ({"gpus": [_gpu(memory_used_mib=10, processes=[{"pid": 5, "used_memory_mib": 11}])]},
         r"processes' use 11 MiB together, more than memory_used_mib 10"),
        ({"gpus": [_gpu(processes=[{"user": "a"}])]}, r"processes\[0\]\.pid' is required"),
        ({"gpus": [_gpu(mig_devices=[{"profile": "1g", "memory_total_mib": 99999, "memory_used_mib": 0}])]},
         r"mig_devices' have more memory together"),
    ],
)
def test_invalid_specs_say_which_field_and_why(spec: Any, pattern: str) -> None:
    with pytest.raises(FakeSpecError, match=pattern) as info:
        parse_spec(spec, source="spec.json")
    assert "spec.json" in str(info.value)
    assert isinstance(info.value, ConfigurationError)  # so `except ValueError` works too


def test_defaults_are_deterministic() -> None:
    spec = {"gpus": [_gpu(), _gpu()]}
    first, again = parse_spec(spec), parse_spec(json.loads(json.dumps(spec)))
    assert [g.uuid for g in first.gpus] == [g.uuid for g in again.gpus]
    assert first.gpus[0].uuid != first.gpus[1].uuid  # same name, different index
    assert first.gpus[0].uuid.startswith("GPU-") and len(first.gpus[0].uuid) == 40
    assert [g.pci_bus_id for g in first.gpus] == ["00000000:01:00.0", "00000000:02:00.0"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")), ids=lambda p: p.stem)
def test_example_specs_load(path: Path) -> None:
    load_spec(path)


def test_fake_returns_what_pynvml_returns() -> None:
    fake = FakeNvml({"driver_version": "550.1", "gpus": [
        _gpu(name="T", temperature_c=50, power_draw_w=87.5, power_limit_w=250, utilization_gpu_pct=3,
             compute_mode="Exclusive_Process", processes=[{"pid": 9, "used_memory_mib": 0}])]})
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetCount() == 1 and fake.nvmlSystemGetDriverVersion() == "550.1"
    assert isinstance(fake.nvmlDeviceGetName(h), str) and fake.nvmlDeviceGetUUID(h).startswith("GPU-")
    pci = fake.nvmlDeviceGetPciInfo(h)
    assert isinstance(pci, pynvml.nvmlPciInfo_t) and pci.busId == "00000000:01:00.0" and pci.bus == 1
    mem = fake.nvmlDeviceGetMemoryInfo(h)
    assert isinstance(mem, pynvml.c_nvmlMemory_t) and mem.total == 16000 * 2**20 and mem.free == mem.total
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 3
    assert fake.nvmlDeviceGetPowerUsage(h) == 87500  # milliwatts, like NVML
    assert fake.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 50
    (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert (proc.pid, proc.usedGpuMemory, proc.gpuInstanceId) == (9, 0, 0xFFFFFFFF)
    assert fake.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST  # constants are the real ones
    fake.nvmlShutdown()


def test_fake_raises_the_real_nvml_errors() -> None:
    fake = FakeNvml({"gpus": [_gpu(), _gpu(lost=True), _gpu(lost_after_calls=1)]})
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported) as info:
        fake.nvmlDeviceGetTemperature(h0, 0)
    assert info.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED and str(info.value) == "Not Supported"
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetHandleByIndex(1)
    h2 = fake.nvmlDeviceGetHandleByIndex(2)
    fake.nvmlDeviceGetUUID(h2)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):  # lost mid-query
        fake.nvmlDeviceGetName(h2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(3)
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()


def test_no_driver_fails_like_a_missing_library() -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml({"no_driver": True}).nvmlInit()


def test_mig_surface() -> None:
    fake = FakeNvml(EXAMPLES / "mig-a100.json")
    fake.nvmlInit()
    parent = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert fake.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    assert fake.nvmlDeviceGetUUID(mig).startswith("MIG-")
    assert fake.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 2g.10gb"
    assert fake.nvmlDeviceGetGpuInstanceId(mig) == 5
    with pytest.raises(pynvml.NVMLError_NotFound):  # empty slot
        fake.nvmlDeviceGetMigDeviceHandleByIndex(parent, 5)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # no utilization in MIG mode
        fake.nvmlDeviceGetUtilizationRates(parent)
    assert len(fake.nvmlDeviceGetComputeRunningProcesses(parent)) == 2
    assert fake.nvmlDeviceGetMigMode(fake.nvmlDeviceGetHandleByIndex(1)) == [0, 0]
