"""Snapshots: what each GPU is doing right now, as frozen dataclasses with units in the names."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpukit.devices import _nvml

__all__ = ["GpuProcess", "GpuSnapshot", "list_gpus", "selectable_units"]

# NVML compute-mode codes -> names as nvidia-smi prints them
_COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
_NVML_TEMPERATURE_GPU = 0
_NOT_AVAILABLE_UINT = 0xFFFFFFFF


@dataclass(frozen=True)
class GpuProcess:
    """A process using a GPU.

    ``user``/``command`` are ``None`` when this process cannot see it (another container's pid
    namespace, or no permission); ``used_memory_bytes`` is ``None`` when the driver cannot tell.
    """

    pid: int
    user: str | None
    command: str | None
    used_memory_bytes: int | None


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU (or one MIG device) at one moment.

    ``index`` is the NVML index: PCI bus order, the order ``nvidia-smi`` shows, and the CUDA order
    once ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (which :func:`~gpukit.devices.use_gpus` sets). A field the
    GPU cannot report is ``None``. ``usable`` is ``False`` when the GPU failed while being read
    ("GPU is lost"); ``error`` then says why. A GPU in MIG mode has ``mig_enabled=True`` and lists
    its MIG devices in ``mig_devices``; those are snapshots too, with ``mig_parent_uuid`` set, the
    parent's ``index``, and a ``MIG-...`` ``uuid`` (what ``CUDA_VISIBLE_DEVICES`` takes).
    """

    index: int
    uuid: str | None
    name: str | None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    temperature_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    compute_mode: str | None = None
    processes: tuple[GpuProcess, ...] = ()
    usable: bool = True
    error: str | None = None
    mig_enabled: bool | None = None
    mig_devices: tuple[GpuSnapshot, ...] = ()
    mig_parent_uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def is_mig(self) -> bool:
        """Whether this is a MIG device (a slice of the GPU ``mig_parent_uuid``)."""
        return self.mig_parent_uuid is not None

    @property
    def short_uuid(self) -> str:
        """``GPU-1a2b3c4d…``: enough of the UUID to recognise it."""
        if self.uuid is None:
            return "uuid n/a"
        return self.uuid[:12] + "…" if len(self.uuid) > 12 else self.uuid

    @property
    def label(self) -> str:
        """``GPU 2 (NVIDIA A100-SXM4-40GB)``, or ``GPU 0 MIG 1g.5gb (MIG-1a2b…)`` for a MIG device."""
        if self.is_mig:
            profile = (self.name or "").rsplit(" MIG ", 1)[-1] or "device"
            return f"GPU {self.index} MIG {profile} ({self.short_uuid})"
        return f"GPU {self.index} ({self.name or 'name n/a'})"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (sizes in bytes), including ``processes`` and ``mig_devices``."""
        return asdict(self)


def list_gpus() -> list[GpuSnapshot]:
    """Snapshot every NVIDIA GPU in NVML index order (PCI bus order, as ``nvidia-smi`` shows).

    Never raises for hardware trouble: a field a GPU does not support is ``None``; a GPU that
    fails while being read is returned with ``usable=False`` and ``error`` set.

    Returns:
        One snapshot per physical GPU, ``[]`` when there is no NVIDIA driver (reported once,
        through the ``gpukit.devices`` logger).

    Raises:
        FakeSpecError: ``GPUKIT_FAKE_GPUS`` names a missing or malformed spec.
    """
    if _nvml.backend() is None:
        return []
    try:
        count = _nvml.query("nvmlDeviceGetCount")
    except _nvml.NvmlError as exc:
        _nvml.logger().warning("gpukit: NVML could not count the GPUs (%s); listing none.", exc)
        return []
    return [_read_gpu(index) for index in range(count)]


def selectable_units(gpus: list[GpuSnapshot]) -> list[GpuSnapshot]:
    """What CUDA can run on: each GPU, except that a MIG-enabled GPU is replaced by its MIG devices."""
    units: list[GpuSnapshot] = []
    for gpu in gpus:
        units.extend(gpu.mig_devices if gpu.mig_enabled and gpu.mig_devices else [gpu])
    return units


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_gpu(index: int) -> GpuSnapshot:
    uuid = name = pci = None
    try:
        handle = _nvml.query("nvmlDeviceGetHandleByIndex", index)
        uuid = _text(_nvml.query("nvmlDeviceGetUUID", handle))
        name = _text(_nvml.query("nvmlDeviceGetName", handle))
        pci_info = _nvml.query("nvmlDeviceGetPciInfo", handle, optional=True)
        pci = None if pci_info is None else _text(pci_info.busId)
        mig_mode = _nvml.query("nvmlDeviceGetMigMode", handle, optional=True)
        mig_enabled = None if mig_mode is None else bool(mig_mode[0])
        mig_devices = _read_mig_devices(handle, index, uuid, pci) if mig_enabled else ()
        fields = _read_common(handle)
        # On a MIG GPU the per-instance lists hold the processes; the parent shows them all again.
        procs = _read_processes(handle) if not mig_enabled else tuple(p for m in mig_devices for p in m.processes)
        mode = _nvml.query("nvmlDeviceGetComputeMode", handle, optional=True)
        power = _nvml.query("nvmlDeviceGetPowerUsage", handle, optional=True)
        limit = _nvml.query("nvmlDeviceGetEnforcedPowerLimit", handle, optional=True)
        return GpuSnapshot(
            index=index, uuid=uuid, name=name, pci_bus_id=pci, **fields,
            temperature_c=_nvml.query("nvmlDeviceGetTemperature", handle, _NVML_TEMPERATURE_GPU, optional=True),
            power_draw_w=None if power is None else power / 1000.0,  # NVML reports milliwatts
            power_limit_w=None if limit is None else limit / 1000.0,
            compute_mode=None if mode is None else _COMPUTE_MODES.get(mode, f"mode {mode}"),
            processes=procs, mig_enabled=mig_enabled, mig_devices=mig_devices,
        )
    except _nvml.NvmlError as exc:
        # Keep what was learnt (to name the GPU) and mark it unusable; never fail the listing.
        return GpuSnapshot(index=index, uuid=uuid, name=name, pci_bus_id=pci, usable=False, error=str(exc))


def _read_common(handle: Any) -> dict[str, Any]:
    # The v2 struct's ``used`` leaves out driver-reserved memory, as nvidia-smi (R510+) does; v1's
    # includes it (hundreds of MiB on an idle GPU). ``free`` is the same in both.
    mem = None
    if _nvml.MEMORY_INFO_V2 is not None:
        mem = _nvml.query("nvmlDeviceGetMemoryInfo", handle, _nvml.MEMORY_INFO_V2, optional=True)
    if mem is None:  # older driver (no nvmlDeviceGetMemoryInfo_v2) or bindings
        mem = _nvml.query("nvmlDeviceGetMemoryInfo", handle)
    util = _nvml.query("nvmlDeviceGetUtilizationRates", handle, optional=True)
    return {
        "memory_total_bytes": int(mem.total),
        "memory_used_bytes": int(mem.used),
        "memory_free_bytes": int(mem.free),
        "utilization_gpu_pct": None if util is None else int(util.gpu),
        "utilization_memory_pct": None if util is None else int(util.memory),
    }


def _read_processes(handle: Any) -> tuple[GpuProcess, ...]:
    # nvidia-ml-py 12+ calls the _v3 symbol for the plain name; drivers before R510 (and some R535
    # releases) only have _v2, where the bindings raise NVMLLibraryMismatchError instead.
    raw = _nvml.query("nvmlDeviceGetComputeRunningProcesses", handle, optional=True,
                      fallbacks=("nvmlDeviceGetComputeRunningProcesses_v2",)) or []
    procs = []
    for p in raw:
        user, command = _nvml.process_details(int(p.pid))
        used = getattr(p, "usedGpuMemory", None)
        procs.append(GpuProcess(pid=int(p.pid), user=user, command=command,
                                used_memory_bytes=None if used is None else int(used)))
    return tuple(procs)


def _read_mig_devices(handle: Any, index: int, parent_uuid: str | None, pci: str | None) -> tuple[GpuSnapshot, ...]:
    slots = _nvml.query("nvmlDeviceGetMaxMigDeviceCount", handle, optional=True) or 0
    devices = []
    for slot in range(slots):
        mig = _nvml.query("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, optional=True)
        if mig is None:  # empty slot (NVML "Not Found")
            continue
        devices.append(GpuSnapshot(
            index=index,
            uuid=_text(_nvml.query("nvmlDeviceGetUUID", mig)),
            name=_text(_nvml.query("nvmlDeviceGetName", mig)),
            pci_bus_id=pci,
            **_read_common(mig),
            processes=_read_processes(mig),
            mig_parent_uuid=parent_uuid,
            gpu_instance_id=_nvml.query("nvmlDeviceGetGpuInstanceId", mig, optional=True),
            compute_instance_id=_nvml.query("nvmlDeviceGetComputeInstanceId", mig, optional=True),
        ))
    return tuple(devices)
