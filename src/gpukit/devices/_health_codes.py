"""NVML's clock-event reason bits and PCIe lane rates, shared by the health reader and the fake spec.

A module of constants only, so the fake's spec parser and the NVML reader both use them without
importing each other.
"""

from __future__ import annotations

__all__ = ["CLOCK_EVENT_REASONS", "PCIE_LANE_GBPS"]

#: NVML clock-event ("throttle") reason bits -> gpukit's names for them, the way nvidia-smi -q
#: words them (``nvmlClocksEventReason*``; the older ``nvmlClocksThrottleReason*`` are the same bits)
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

#: usable GB/s per lane and direction after line encoding, by PCIe generation
PCIE_LANE_GBPS: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
