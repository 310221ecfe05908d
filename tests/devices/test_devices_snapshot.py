"""list_gpus(): snapshots from the fake through the same NVML code path as real GPUs."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from typing import Any, Callable

import pytest

from gpukit.devices import FakeNvml, GpuProcess, driver_version, list_gpus, selectable_units, unavailable_reason
from gpukit.devices import _nvml


def _gpu(**extra: Any) -> dict[str, Any]:
    return {"name": "Fake GPU", "memory_total_mib": 16000, "memory_used_mib": 0, **extra}


def test_shared_box_snapshot(use_spec: Callable[[Any], Any]) -> None:
    use_spec("shared-4gpu")
    gpus = list_gpus()
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    g0 = gpus[0]
    assert g0.name == "NVIDIA TITAN X (Pascal)" and g0.uuid == "GPU-5a9b0c3e-1f2d-4e6a-8b7c-0d1e2f3a4b5c"
    assert g0.pci_bus_id == "00000000:02:00.0"
    assert g0.memory_total_bytes == 12196 * 2**20 and g0.memory_used_bytes == 10995 * 2**20
    assert g0.memory_free_bytes == (12196 - 10995) * 2**20
    assert (g0.utilization_gpu_pct, g0.utilization_memory_pct, g0.temperature_c) == (97, 61, 83)
    assert (g0.power_draw_w, g0.power_limit_w, g0.compute_mode) == (231.0, 250.0, "Default")
    assert g0.processes[0] == GpuProcess(44683, "alice", "python train.py --lr 3e-4", 7703 * 2**20)
    assert g0.usable and g0.error is None and g0.mig_enabled is None and not g0.is_mig
    assert driver_version() == "535.104.05" and unavailable_reason() is None
    json.dumps([g.to_dict() for g in gpus])  # JSON-ready


def test_not_supported_fields_are_none(use_spec: Callable[[Any], Any]) -> None:
    use_spec({"gpus": [_gpu()]})
    (g,) = list_gpus()
    assert g.usable
    assert (g.utilization_gpu_pct, g.temperature_c, g.power_draw_w, g.power_limit_w, g.compute_mode) == (None,) * 5


def test_lost_gpu_is_listed_unusable(use_spec: Callable[[Any], Any]) -> None:
    use_spec("lost-gpu")
    ok, lost = list_gpus()
    assert ok.usable and ok.name == "Tesla T4"
    assert not lost.usable and lost.error == "GPU is lost" and lost.index == 1


def test_gpu_lost_mid_query_keeps_what_was_read(use_spec: Callable[[Any], Any]) -> None:
    use_spec({"gpus": [_gpu(), _gpu(name="Dying", lost_after_calls=2), _gpu()]})
    first, dying, last = list_gpus()
    assert first.usable and last.usable  # the listing goes on past the failure
    assert not dying.usable and dying.error == "GPU is lost"
    assert dying.name == "Dying" and dying.uuid is not None and dying.memory_total_bytes is None


def test_mig_gpu_lists_its_mig_devices(use_spec: Callable[[Any], Any]) -> None:
    use_spec("mig-a100")
    parent, whole = list_gpus()
    assert parent.mig_enabled is True and whole.mig_enabled is False
    assert parent.utilization_gpu_pct is None  # NVML reports none in MIG mode
    assert [m.uuid[:8] for m in parent.mig_devices] == ["MIG-aa11", "MIG-bb22", "MIG-cc33"]
    m0 = parent.mig_devices[0]
    assert m0.is_mig and m0.mig_parent_uuid == parent.uuid and m0.index == 0
    assert (m0.gpu_instance_id, m0.compute_instance_id) == (1, 0)
    assert m0.memory_total_bytes == 19968 * 2**20 and m0.processes[0].user == "dave"
    assert m0.label == "GPU 0 MIG 3g.20gb (MIG-aa11bb22…)"
    assert {p.pid for p in parent.processes} == {7001, 7002}
    assert selectable_units([parent, whole]) == [*parent.mig_devices, whole]


def test_no_driver_returns_empty_and_says_so_once(use_spec: Callable[[Any], Any],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    use_spec("no-driver")
    with caplog.at_level(logging.WARNING, logger="gpukit.devices"):
        assert list_gpus() == [] and list_gpus() == []
        _nvml.shutdown()  # even a re-initialisation does not repeat the notice
        assert list_gpus() == []
    notices = [r.getMessage() for r in caplog.records if "no NVIDIA GPU/driver found" in r.getMessage()]
    assert len(notices) == 1 and "NVML Shared Library Not Found" in notices[0]
    assert driver_version() is None


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_real_nvml_without_driver_is_normal() -> None:
    assert list_gpus() == []
    assert "no NVIDIA GPU/driver found" in (unavailable_reason() or "")


def test_init_is_lazy_once_and_thread_safe() -> None:
    fake = FakeNvml({"gpus": [_gpu(), _gpu()]})
    with fake:
        assert fake.call_log == []  # installing does not touch NVML
        barrier = threading.Barrier(8)
        results: list[int] = []

        def worker() -> None:
            barrier.wait()
            results.append(len(list_gpus()))

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [2] * 8
        assert fake.call_log.count("nvmlInit") == 1


def test_nvml_is_shut_down_at_exit(tmp_path: Any) -> None:
    script = (
        "import atexit\n"
        "from gpukit.devices import FakeNvml, list_gpus\n"
        "fake = FakeNvml({'gpus': [{'name': 'x', 'memory_total_mib': 1, 'memory_used_mib': 0}]}).install()\n"
        # registered before gpukit's hook, so it runs after it (atexit is last-in, first-out)
        "atexit.register(lambda: print('calls:', ','.join(fake.call_log)))\n"
        "list_gpus()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().startswith("calls: nvmlInit,") and out.stdout.strip().endswith(",nvmlShutdown")


def test_changed_spec_file_is_picked_up(use_spec: Callable[[Any], Any]) -> None:
    path = use_spec({"gpus": [_gpu()]})
    assert len(list_gpus()) == 1
    path.write_text(json.dumps({"gpus": [_gpu(), _gpu()]}))
    import os

    os.utime(path, ns=(0, 10**18))  # a distinct mtime even on coarse-grained filesystems
    assert len(list_gpus()) == 2


class _DriverWithoutV3(FakeNvml):
    """A driver without the ``_v3`` process symbol (before R510, some R535 releases): nvidia-ml-py
    12+ maps the plain name to ``_v3`` and raises NVMLLibraryMismatchError -- not an NVMLError."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Any:
        import pynvml

        raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> Any:
        return FakeNvml.nvmlDeviceGetComputeRunningProcesses(self, handle)


def test_processes_fall_back_to_v2_on_drivers_without_v3() -> None:
    spec = {"gpus": [_gpu(memory_used_mib=100,
                          processes=[{"pid": 4242, "user": "bob", "command": "python", "used_memory_mib": 100}])]}
    with _DriverWithoutV3(spec):
        (gpu,) = list_gpus()  # used to raise NVMLLibraryMismatchError out of list_gpus
    assert gpu.usable and [p.pid for p in gpu.processes] == [4242]


def test_process_query_the_driver_lacks_entirely_leaves_the_gpu_usable() -> None:
    import pynvml

    class NoProcessQuery(FakeNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Any:
            raise pynvml.NVMLLibraryMismatchError("no _v3")

    with NoProcessQuery({"gpus": [_gpu()]}):
        (gpu,) = list_gpus()
        assert gpu.usable and gpu.processes == ()
        with pytest.raises(_nvml.NvmlError):  # not optional: an NVML error, never a foreign type
            _nvml.query("nvmlDeviceGetComputeRunningProcesses", _nvml.query("nvmlDeviceGetHandleByIndex", 0))


def test_memory_is_read_with_the_v2_struct_like_nvidia_smi() -> None:
    import pynvml

    seen: list[Any] = []

    class ReservedMemory(FakeNvml):
        # a real driver: v1 "used" includes driver-reserved memory, v2 "used" leaves it out
        def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
            seen.append(version)
            mem = super().nvmlDeviceGetMemoryInfo(handle, version)
            if version:
                mem.reserved = 512 * 2**20
                mem.used -= mem.reserved
            return mem

    with ReservedMemory({"gpus": [_gpu(memory_used_mib=1024)]}):
        (gpu,) = list_gpus()
    assert seen == [pynvml.nvmlMemory_v2]
    assert gpu.memory_used_bytes == 512 * 2**20 and gpu.memory_free_bytes == (16000 - 1024) * 2**20


def test_memory_falls_back_to_v1_without_the_v2_function() -> None:
    import pynvml

    class OldDriver(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
            if version:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return super().nvmlDeviceGetMemoryInfo(handle)

    with OldDriver({"gpus": [_gpu(memory_used_mib=1024)]}):
        (gpu,) = list_gpus()
    assert gpu.usable and gpu.memory_used_bytes == 1024 * 2**20


def test_process_details_of_a_large_fake_are_one_lookup_each() -> None:
    """Listing every process of a fake is linear: the spec is indexed by pid once, not scanned per pid
    (1024 GPUs x 8 processes took 2.7 s for `gpukit ls` when it was)."""
    gpus = [_gpu(memory_used_mib=100, processes=[{"pid": 1000 + 8 * g + p, "user": f"u{g}", "command": f"job {g}.{p}",
                             "used_memory_mib": 10} for p in range(8)]) for g in range(64)]
    gpus[1]["processes"].append({"pid": 1000, "user": "second", "command": "listed twice", "used_memory_mib": 1})
    fake = FakeNvml({"gpus": gpus})
    assert fake.gpukit_process_details(1000 + 8 * 5 + 3) == ("u5", "job 5.3")
    assert fake.gpukit_process_details(1000) == ("u0", "job 0.0")  # the first listing wins, as a scan finds it
    assert fake.gpukit_process_details(99) == (None, None)
    fake.spec = None  # type: ignore[assignment]  # answered from the index from now on, never by a scan
    assert fake.gpukit_process_details(1000 + 8 * 63 + 7) == ("u63", "job 63.7")
    with fake:
        fake.spec = FakeNvml({"gpus": gpus}).spec
        assert sum(len(g.processes) for g in list_gpus()) == 64 * 8 + 1
