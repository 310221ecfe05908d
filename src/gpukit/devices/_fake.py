"""FakeNvml: a stand-in for the ``pynvml`` module, driven by a JSON spec.

It offers the same functions gpukit's NVML module calls, returns the same kinds of values (``str``
names and UUIDs, ctypes structs with ``.total/.used/.free`` and ``.gpu/.memory``, process objects
with ``.pid/.usedGpuMemory``, milliwatts) and fails the same way, by raising the real
``pynvml.NVMLError`` subclasses with the real codes. So the code path that reads a real GPU is the
code path the tests and docs exercise.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping, NoReturn

import pynvml

from gpukit.devices._override import set_backend_override
from gpukit.devices._spec import FakeGpu, FakeMigDevice, FakeProcess, FakeSpec, load_spec, parse_spec

__all__ = ["FakeNvml"]

# What NVML reports for "no value" in unsigned fields (e.g. the GPU instance of a non-MIG process).
_NOT_AVAILABLE_UINT = 0xFFFFFFFF
# The most MIG devices one GPU can hold (A100/H100: 7 GPU instances).
_MAX_MIG_DEVICES = 7


class _Handle:
    """Opaque device handle, like ``pynvml.c_nvmlDevice_t``."""

    __slots__ = ("gpu_index", "mig_slot")

    def __init__(self, gpu_index: int, mig_slot: int | None = None) -> None:
        self.gpu_index = gpu_index
        self.mig_slot = mig_slot

    def __repr__(self) -> str:
        mig = "" if self.mig_slot is None else f", mig_slot={self.mig_slot}"
        return f"<FakeNvml device handle gpu={self.gpu_index}{mig}>"


def _raise(code: int) -> NoReturn:
    # NVMLError(code) returns the matching subclass, e.g. NVMLError_GpuIsLost.
    raise pynvml.NVMLError(code)


class FakeNvml:
    """Fake NVIDIA driver for machines without GPUs: tests, docs, demos.

    Use it from Python as a context manager, or from the shell through the environment variable
    ``GPUKIT_FAKE_GPUS=/path/spec.json``, which makes the whole library and CLI use it::

        with FakeNvml({"gpus": [{"name": "NVIDIA A100", "memory_total_mib": 40960, "memory_used_mib": 0}]}):
            print(gpukit.devices.list_gpus())

    Spec format (JSON object; every GPU field but ``name`` and the two memory fields is optional, a
    missing optional field reads as NVML's "Not Supported", i.e. ``None`` in snapshots)::

        {"driver_version": "535.104.05", "no_driver": false,
         "gpus": [{"name": "...", "uuid": "GPU-...", "pci_bus_id": "00000000:02:00.0",
                   "memory_total_mib": 12196, "memory_used_mib": 10995,
                   "utilization_gpu_pct": 0, "utilization_memory_pct": 0, "temperature_c": 76,
                   "power_draw_w": 87, "power_limit_w": 250, "compute_mode": "Default",
                   "lost": false, "lost_after_calls": null,
                   "processes": [{"pid": 44683, "user": "alice", "command": "python", "used_memory_mib": 3289}],
                   "mig_mode": null, "persistence_mode": true,
                   "health": {"pcie_gen": 4, "pcie_width": 16, "clock_event_reasons": ["sw_power_cap"], ...},
                   "mig_devices": [{"profile": "1g.5gb", "memory_total_mib": 4864, "memory_used_mib": 0,
                                    "uuid": "MIG-...", "gpu_instance_id": 7, "compute_instance_id": 0,
                                    "processes": []}]}]}

    List order is the NVML index. ``no_driver: true`` makes ``nvmlInit`` fail like a machine
    without the driver library. ``lost: true`` makes every query of that GPU fail with
    "GPU is lost"; ``lost_after_calls: N`` lets N queries succeed first (lost mid-listing).
    A GPU with ``mig_devices`` is in MIG mode: queries of the parent report no utilization, and
    its MIG devices are reachable through ``nvmlDeviceGetMigDeviceHandleByIndex``.
    ``persistence_mode`` (``true``/``false``) is what ``nvmlDeviceGetPersistenceMode`` reports;
    left out, it is "Not Supported". ``health`` holds what ``gpukit doctor --gpu`` reads (PCIe link,
    clock-event reasons, ECC, retired memory, SM clocks: see :mod:`gpukit.devices._spec_health`).

    Args:
        spec: a spec mapping, a parsed :class:`FakeSpec`, or a path to a JSON spec file.

    Raises:
        FakeSpecError: the spec is missing, not JSON, or malformed (the message names the field).
    """

    def __init__(self, spec: Mapping[str, Any] | FakeSpec | str | os.PathLike[str]) -> None:
        if isinstance(spec, FakeSpec):
            self.spec = spec
        elif isinstance(spec, Mapping):
            self.spec = parse_spec(spec)
        else:
            self.spec = load_spec(spec)
        self._lock = threading.Lock()
        self._init_count = 0
        self._calls: dict[int, int] = {}  # GPU index -> successful device queries so far
        self.call_log: list[str] = []  # names of the NVML functions called, for tests
        self._pid_details: dict[int, tuple[str | None, str | None]] | None = None  # pid -> (user, command)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> FakeNvml:
        """Load a spec file (what ``GPUKIT_FAKE_GPUS`` points at)."""
        return cls(path)

    # -- installing as gpukit's backend -------------------------------------------------------
    def install(self) -> FakeNvml:
        """Make gpukit use this fake (instead of the real driver or ``GPUKIT_FAKE_GPUS``) until :meth:`uninstall`."""
        set_backend_override(self)
        return self

    def uninstall(self) -> None:
        """Stop using this fake; gpukit goes back to ``GPUKIT_FAKE_GPUS`` or the real driver."""
        set_backend_override(None)

    def __enter__(self) -> FakeNvml:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __getattr__(self, name: str) -> Any:
        # Constants and error classes (NVML_ERROR_*, NVMLError_GpuIsLost, ...) are the real module's.
        if name.startswith(("NVML_", "NVMLError")):
            return getattr(pynvml, name)
        raise AttributeError(f"FakeNvml has no attribute {name!r} (not part of the NVML surface gpukit uses)")

    # -- library -----------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.call_log.append("nvmlInit")
        if self.spec.no_driver:
            _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        with self._lock:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        self.call_log.append("nvmlShutdown")
        with self._lock:
            if self._init_count == 0:
                _raise(pynvml.NVML_ERROR_UNINITIALIZED)
            self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init("nvmlSystemGetDriverVersion")
        return self.spec.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check_init("nvmlDeviceGetCount")
        return len(self.spec.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.spec.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.spec.gpus[index].lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return _Handle(index)

    # -- per device ----------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._query("nvmlDeviceGetUUID", handle, lambda g, m: g.uuid if m is None else m.uuid)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._query("nvmlDeviceGetName", handle,
                           lambda g, m: g.name if m is None else f"{g.name} MIG {m.profile}")

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> pynvml.nvmlPciInfo_t:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> pynvml.nvmlPciInfo_t:
            info = pynvml.nvmlPciInfo_t()
            info.busId = g.pci_bus_id.encode()  # stored as bytes; pynvml structs read it back as str
            info.busIdLegacy = g.pci_bus_id[4:].encode()
            domain, bus, dev_fn = g.pci_bus_id.split(":")
            info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(dev_fn.split(".")[0], 16)
            return info

        return self._query("nvmlDeviceGetPciInfo", handle, read)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: Any = None) -> Any:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> Any:
            src = g if m is None else m
            # like pynvml: the v1 struct without a version, the v2 one (with ``reserved``) with it
            mem: Any = pynvml.c_nvmlMemory_t() if not version else pynvml.c_nvmlMemory_v2_t()
            if version:
                mem.version, mem.reserved = version, 0
            mem.total, mem.used = src.memory_total_bytes, src.memory_used_bytes
            mem.free = src.memory_total_bytes - src.memory_used_bytes
            return mem

        return self._query("nvmlDeviceGetMemoryInfo", handle, read)

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> pynvml.c_nvmlUtilization_t:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> pynvml.c_nvmlUtilization_t:
            # NVML has no utilization for MIG devices, nor for a parent GPU in MIG mode.
            if m is not None or g.mig_mode or g.utilization_gpu_pct is None:
                _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            util = pynvml.c_nvmlUtilization_t()
            util.gpu = g.utilization_gpu_pct
            util.memory = g.utilization_memory_pct or 0
            return util

        return self._query("nvmlDeviceGetUtilizationRates", handle, read)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        return self._query("nvmlDeviceGetTemperature", handle, lambda g, m: self._supported(g.temperature_c, m))

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return self._query("nvmlDeviceGetPowerUsage", handle, lambda g, m: self._milliwatts(g.power_draw_w, m))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:
        return self._query("nvmlDeviceGetEnforcedPowerLimit", handle, lambda g, m: self._milliwatts(g.power_limit_w, m))

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        return self._query("nvmlDeviceGetComputeMode", handle, lambda g, m: self._supported(g.compute_mode, m))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> list[Any]:
            if m is not None:
                return [self._process(p, m) for p in m.processes]
            # On a MIG-enabled parent NVML lists every instance's processes, tagged with their instance.
            return [self._process(p, None) for p in g.processes] + [
                self._process(p, mig) for mig in g.mig_devices for p in mig.processes
            ]

        return self._query("nvmlDeviceGetComputeRunningProcesses", handle, read)

    def nvmlDeviceGetPersistenceMode(self, handle: _Handle) -> int:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> int:
            on = self._supported(g.persistence_mode, m)
            return pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED

        return self._query("nvmlDeviceGetPersistenceMode", handle, read)

    # -- health (gpukit doctor --gpu) -------------------------------------------------------------
    def _health(self, name: str, handle: _Handle, field: str, convert: Callable[[Any], Any] = lambda v: v) -> Any:
        return self._query(name, handle, lambda g, m: convert(self._supported(getattr(g.health, field), m)))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetCurrPcieLinkGeneration", handle, "pcie_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetCurrPcieLinkWidth", handle, "pcie_width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetMaxPcieLinkGeneration", handle, "pcie_max_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetMaxPcieLinkWidth", handle, "pcie_max_width")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetCurrentClocksEventReasons", handle, "clock_event_mask")

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        if error_type != pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # the spec holds uncorrected counts only
        field = "ecc_uncorrected_volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "ecc_uncorrected_aggregate"
        return self._health("nvmlDeviceGetTotalEccErrors", handle, field)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: _Handle) -> int:
        return self._health("nvmlDeviceGetRetiredPagesPendingStatus", handle, "retired_pages_pending",
                            lambda on: pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> tuple[int, int, int, int]:
            pending = self._supported(g.health.remapped_rows_pending, m)
            return 0, 0, int(pending), int(bool(g.health.remapped_rows_failure))

        return self._query("nvmlDeviceGetRemappedRows", handle, read)

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        return self._health("nvmlDeviceGetClockInfo", handle, "sm_clock_mhz")

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, clock_type: int) -> int:
        return self._health("nvmlDeviceGetMaxClockInfo", handle, "sm_max_clock_mhz")

    # -- MIG ---------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> list[int]:
            if m is not None or g.mig_mode is None:
                _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            mode = pynvml.NVML_DEVICE_MIG_ENABLE if g.mig_mode else pynvml.NVML_DEVICE_MIG_DISABLE
            return [mode, mode]  # [current, pending]

        return self._query("nvmlDeviceGetMigMode", handle, read)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> int:
            if m is not None or g.mig_mode is None:
                _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return max(_MAX_MIG_DEVICES, len(g.mig_devices))

        return self._query("nvmlDeviceGetMaxMigDeviceCount", handle, read)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        def read(g: FakeGpu, m: FakeMigDevice | None) -> _Handle:
            if m is not None or not g.mig_mode:
                _raise(pynvml.NVML_ERROR_NOT_SUPPORTED if m is not None else pynvml.NVML_ERROR_INVALID_ARGUMENT)
            if not 0 <= index < len(g.mig_devices):
                _raise(pynvml.NVML_ERROR_NOT_FOUND)  # an empty slot, as on real hardware
            return _Handle(handle.gpu_index, index)

        return self._query("nvmlDeviceGetMigDeviceHandleByIndex", handle, read)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        return self._query("nvmlDeviceGetGpuInstanceId", handle, lambda g, m: self._mig_only(m).gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        return self._query("nvmlDeviceGetComputeInstanceId", handle, lambda g, m: self._mig_only(m).compute_instance_id)

    # -- not NVML: what psutil answers on a real machine ---------------------------------------
    def gpukit_process_details(self, pid: int) -> tuple[str | None, str | None]:
        """``(user, command)`` of a process in the spec; ``(None, None)`` for unknown pids.

        One dictionary lookup: the spec (frozen) is indexed by pid on the first call, so listing
        every process of a spec costs linear time, not a scan of the spec per process.
        """
        if self._pid_details is None:
            index: dict[int, tuple[str | None, str | None]] = {}
            for gpu in self.spec.gpus:
                for proc in (*gpu.processes, *(p for m in gpu.mig_devices for p in m.processes)):
                    index.setdefault(proc.pid, (proc.user, proc.command))  # the first listed wins, as a scan found
            self._pid_details = index
        return self._pid_details.get(pid, (None, None))

    # -- helpers ------------------------------------------------------------------------------
    def _check_init(self, name: str) -> None:
        self.call_log.append(name)
        if self._init_count == 0:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)

    def _query(self, name: str, handle: _Handle, read: Callable[[FakeGpu, FakeMigDevice | None], Any]) -> Any:
        self._check_init(name)
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu_index < len(self.spec.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.spec.gpus[handle.gpu_index]
        with self._lock:
            done = self._calls.get(handle.gpu_index, 0)
            if gpu.lost or (gpu.lost_after_calls is not None and done >= gpu.lost_after_calls):
                _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
            self._calls[handle.gpu_index] = done + 1
        mig = None if handle.mig_slot is None else gpu.mig_devices[handle.mig_slot]
        return read(gpu, mig)

    @staticmethod
    def _supported(value: Any, mig: FakeMigDevice | None) -> Any:
        if value is None or mig is not None:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    @classmethod
    def _milliwatts(cls, watts: float | None, mig: FakeMigDevice | None) -> int:
        return int(round(cls._supported(watts, mig) * 1000))

    @staticmethod
    def _mig_only(mig: FakeMigDevice | None) -> FakeMigDevice:
        if mig is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # not a MIG device handle
        return mig

    @staticmethod
    def _process(proc: FakeProcess, mig: FakeMigDevice | None) -> Any:
        return pynvml.nvmlFriendlyObject({
            "pid": proc.pid,
            "usedGpuMemory": proc.used_memory_bytes,  # None where the driver cannot tell
            "gpuInstanceId": _NOT_AVAILABLE_UINT if mig is None else mig.gpu_instance_id,
            "computeInstanceId": _NOT_AVAILABLE_UINT if mig is None else mig.compute_instance_id,
        })

    def __repr__(self) -> str:
        return f"FakeNvml({self.spec.source!r}, gpus={len(self.spec.gpus)})"
