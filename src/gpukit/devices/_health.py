"""What NVML says about a GPU's health: PCIe link, clock-event (throttle) reasons, ECC, retired memory.

The facts ``gpukit doctor --gpu`` judges its measurements against. Every field is ``None`` where
the GPU or driver cannot report it (NVML's "Not Supported", e.g. ECC on consumer cards, PCIe
inside some virtual machines); a GPU that is lost raises like every other query.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpukit.devices import _nvml
from gpukit.devices._health_codes import CLOCK_EVENT_REASONS, PCIE_LANE_GBPS

__all__ = ["GpuHealth", "gpu_health", "persistence_mode", "CLOCK_EVENT_REASONS", "PCIE_LANE_GBPS"]

_NVML_CLOCK_SM = 1
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC, _NVML_AGGREGATE_ECC = 0, 1
_NVML_FEATURE_ENABLED = 1


@dataclass(frozen=True)
class GpuHealth:
    """NVML's health facts of one GPU (``None``: not reported).

    Attributes:
        index: the NVML index.
        pcie_gen, pcie_width: the link as trained now (an idle GPU may drop to a lower
            generation to save power: read it under load).
        pcie_max_gen, pcie_max_width: the most the GPU and the slot allow.
        clock_event_reasons: why the clocks are below their maximum now (``"sw_power_cap"``,
            ``"hw_thermal_slowdown"``...); ``()`` when nothing holds them back.
        ecc_uncorrected_volatile: uncorrected ECC errors since the driver loaded (a reset clears them).
        ecc_uncorrected_aggregate: uncorrected ECC errors over the GPU's life.
        retired_pages_pending: pages are waiting to be retired at the next reset (pre-Ampere).
        remapped_rows_pending: rows are waiting to be remapped at the next reset (Ampere+).
        remapped_rows_failure: a row remapping failed: the GPU needs service.
        sm_clock_mhz, sm_max_clock_mhz: the streaming multiprocessors' clock now and at most.
    """

    index: int
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    sm_clock_mhz: int | None = None
    sm_max_clock_mhz: int | None = None

    def link_peak_gbps(self, *, current: bool = False) -> float | None:
        """The PCIe link's peak one-way bandwidth in GB/s (the maximum link, or the current one)."""
        gen, width = (self.pcie_gen, self.pcie_width) if current else (self.pcie_max_gen, self.pcie_max_width)
        if gen is None or width is None or gen not in PCIE_LANE_GBPS:
            return None
        return PCIE_LANE_GBPS[gen] * width

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["clock_event_reasons"] = None if self.clock_event_reasons is None else list(self.clock_event_reasons)
        return out


def _reasons(mask: int | None) -> tuple[str, ...] | None:
    if mask is None:
        return None
    return tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)


def gpu_health(index: int) -> GpuHealth:
    """Read :class:`GpuHealth` of the GPU at NVML ``index``.

    Raises:
        RuntimeError: NVML is unavailable (no driver).
        NvmlError: the GPU is lost, or ``index`` is out of range.
    """
    handle = _nvml.query("nvmlDeviceGetHandleByIndex", index)

    def opt(name: str, *args: Any, fallbacks: tuple[str, ...] = ()) -> Any:
        return _nvml.query(name, handle, *args, optional=True, fallbacks=fallbacks)

    remapped = opt("nvmlDeviceGetRemappedRows")  # (correctable, uncorrectable, pending, failure)
    retired = opt("nvmlDeviceGetRetiredPagesPendingStatus")
    return GpuHealth(
        index=index,
        pcie_gen=opt("nvmlDeviceGetCurrPcieLinkGeneration"),
        pcie_width=opt("nvmlDeviceGetCurrPcieLinkWidth"),
        pcie_max_gen=opt("nvmlDeviceGetMaxPcieLinkGeneration"),
        pcie_max_width=opt("nvmlDeviceGetMaxPcieLinkWidth"),
        clock_event_reasons=_reasons(opt("nvmlDeviceGetCurrentClocksEventReasons",
                                         fallbacks=("nvmlDeviceGetCurrentClocksThrottleReasons",))),
        ecc_uncorrected_volatile=opt("nvmlDeviceGetTotalEccErrors", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                     _NVML_VOLATILE_ECC),
        ecc_uncorrected_aggregate=opt("nvmlDeviceGetTotalEccErrors", _NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                      _NVML_AGGREGATE_ECC),
        retired_pages_pending=None if retired is None else retired == _NVML_FEATURE_ENABLED,
        remapped_rows_pending=None if remapped is None else bool(remapped[2]),
        remapped_rows_failure=None if remapped is None else bool(remapped[3]),
        sm_clock_mhz=opt("nvmlDeviceGetClockInfo", _NVML_CLOCK_SM),
        sm_max_clock_mhz=opt("nvmlDeviceGetMaxClockInfo", _NVML_CLOCK_SM),
    )


def persistence_mode(index: int) -> bool | None:
    """Whether the GPU at NVML ``index`` is in persistence mode (``None``: not reported, or NVML failed).

    Raises:
        RuntimeError: NVML is unavailable (no driver).
    """
    try:
        handle = _nvml.query("nvmlDeviceGetHandleByIndex", index)
        mode = _nvml.query("nvmlDeviceGetPersistenceMode", handle, optional=True)
    except _nvml.NvmlError:
        return None
    return None if mode is None else mode == _NVML_FEATURE_ENABLED
