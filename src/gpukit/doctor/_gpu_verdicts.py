"""Verdicts of ``gpukit doctor --gpu``: measurements and NVML facts in, findings with fixes out.

Pure functions (no torch, no NVML), so every verdict is tested against the fake NVML's health
facts and made-up measurements.
"""

from __future__ import annotations

from typing import Any

from gpukit._util.units import format_bytes
from gpukit.devices import GpuHealth, dense_peak
from gpukit.doctor._finding import Finding
from gpukit.doctor._gpu_floors import (
    MATMUL_FLOOR_SHARE, MEMORY_FLOOR_SHARE, copy_floor_gbps, matmul_reference, memory_reference_gbps,
)

__all__ = ["judge_gpu", "judge_nvml_facts", "judge_allreduce", "ALLOCATABLE_OK"]

#: allocatable memory at or above this share of what NVML reports free (the CUDA context and
#: allocator granularity take the rest)
ALLOCATABLE_OK = 0.9
_HOLDING_BACK = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                 "hw_power_brake_slowdown")
_REASON_WORDS = {
    "sw_power_cap": "power (software power cap)", "hw_slowdown": "hardware slowdown (power or heat)",
    "sw_thermal_slowdown": "heat (software thermal slowdown)", "hw_thermal_slowdown": "heat (hardware thermal slowdown)",
    "hw_power_brake_slowdown": "power brake (external power supply signal)",
    "applications_clocks_setting": "application clocks set below maximum",
}


def _reasons(health: dict[str, Any] | None) -> list[str]:
    return [r for r in (health or {}).get("clock_event_reasons") or () if r in _HOLDING_BACK]


def _link(gen: int | None, width: int | None) -> str:
    return f"PCIe gen{gen} x{width}" if gen and width else "PCIe link n/a"


def judge_link(label: str, name: str, health: GpuHealth, during: dict[str, Any] | None) -> Finding:
    """The link as trained under load against the most it could be."""
    gen = (during or {}).get("pcie_gen") or health.pcie_gen
    width = (during or {}).get("pcie_width") or health.pcie_width
    details = {"gen": gen, "width": width, "max_gen": health.pcie_max_gen, "max_width": health.pcie_max_width}
    if None in (gen, width, health.pcie_max_gen, health.pcie_max_width):
        return Finding(name, "info", f"{label}: NVML does not report the PCIe link (a virtual machine?)", None, details)
    if gen < health.pcie_max_gen or width < health.pcie_max_width:
        return Finding(name, "warn",
                       f"{label}: the PCIe link runs at {_link(gen, width)} under load, of "
                       f"{_link(health.pcie_max_gen, health.pcie_max_width)} possible",
                       "reseat the card or check the slot, riser and BIOS PCIe settings", details)
    return Finding(name, "ok", f"{label}: {_link(gen, width)} under load, its maximum", None, details)


def judge_copies(label: str, name: str, health: GpuHealth, copies: dict[str, Any]) -> Finding:
    """Pinned copies each way against the floor for the link (48 GB/s on PCIe gen5 x16), their sustained minimum."""
    pinned, pageable = copies["h2d_pinned_gbps"], copies["h2d_pageable_gbps"]
    sustained = {"host->device": copies.get("h2d_pinned_min_gbps", pinned),
                 "device->host": copies.get("d2h_pinned_min_gbps", copies["d2h_pinned_gbps"])}
    peak = health.link_peak_gbps()
    floor = copy_floor_gbps(peak)
    details = {**{k: v for k, v in copies.items() if k != "during"}, "link_peak_gbps": peak, "floor_gbps": floor}
    figures = (f"host->device {pinned:.1f} GB/s pinned, {pageable:.1f} GB/s pageable "
               f"(device->host pinned {copies['d2h_pinned_gbps']:.1f} GB/s)")
    if peak is None or floor is None:
        return Finding(name, "info", f"{label}: {figures}; the link's peak is not reported, so no floor", None, details)
    share = pinned / peak
    details["share_of_peak"] = share
    link = _link(health.pcie_max_gen, health.pcie_max_width)
    words = f"{label}: {figures}: pinned at {share:.0%} of the {link} peak ({peak:.1f} GB/s)"
    short = [f"{way} sustained minimum {gbps:.1f} GB/s" for way, gbps in sustained.items() if gbps < floor]
    if short:
        details["failed_floor"] = "copy_floor_gbps"
        return Finding(name, "warn", f"{words}; below the floor of {floor:.1f} GB/s for {link} "
                       f"(48 GB/s on gen5 x16): " + ", ".join(short),
                       "another job may be copying on the same link or CPU socket; check `gpukit ls`, the "
                       "PCIe link above, and NUMA placement (run on the CPU socket the GPU hangs off)", details)
    return Finding(name, "ok", f"{words}; both ways sustain the {floor:.1f} GB/s floor", None, details)


def judge_matmul(label: str, name: str, gpu_name: str | None, matmul: dict[str, Any]) -> Finding:
    """A large matrix product's sustained minimum against the model's reference (measured, or assumed)."""
    dtype = "bf16" if matmul["dtype"] == "bfloat16" else "fp16"
    found = dense_peak(gpu_name, dtype)
    peak = None if found is None else found.tflops
    reference = matmul_reference(gpu_name, dtype)
    tflops = matmul["tflops"]
    sustained = matmul.get("tflops_min", tflops)
    during = matmul.get("during") or {}
    details = {**{k: v for k, v in matmul.items() if k != "during"}, "spec_peak_tflops": peak,
               "clock_event_reasons": during.get("clock_event_reasons"), "sm_clock_mhz": during.get("sm_clock_mhz")}
    head = f"{label}: {matmul['n']}^3 {dtype} products at {tflops:.0f} TFLOP/s (sustained minimum {sustained:.0f})"
    if peak is None or reference is None:
        return Finding(name, "info", f"{head}; no data-sheet peak known for {gpu_name!r}", None, details)
    share = tflops / peak
    floor = MATMUL_FLOOR_SHARE * reference[0]
    details.update(share_of_peak=share, reference_tflops=reference[0], reference_source=reference[1],
                   floor_tflops=floor)
    head += f", {share:.0%} of its {peak:g} TFLOP/s peak"
    if sustained >= floor:
        return Finding(name, "ok", f"{head}; floor {floor:.0f} ({MATMUL_FLOOR_SHARE:.0%} of the {reference[1]})",
                       None, details)
    details["failed_floor"] = "matmul_floor_tflops"
    why = _reasons(during)
    clock = during.get("sm_clock_mhz"), during.get("sm_max_clock_mhz")
    said = ("throttled for " + " and ".join(_REASON_WORDS.get(r, r) for r in why)) if why else "no throttle reason reported"
    if all(clock):
        said += f"; SM clock {clock[0]} of {clock[1]} MHz"
    return Finding(name, "warn", f"{head}: below the floor of {floor:.0f} TFLOP/s ({MATMUL_FLOOR_SHARE:.0%} of the "
                   f"{reference[1]}): {said}",
                   "check cooling and power limits (`nvidia-smi -q -d PERFORMANCE,POWER`), and whether another "
                   "process shares the GPU (`gpukit ls`)", details)


def judge_device_memory(label: str, name: str, gpu_name: str | None, memory: dict[str, Any] | None) -> Finding:
    """Device memory bandwidth (a large device-to-device copy), its sustained minimum against the data sheet's."""
    if not memory:
        return Finding(name, "info", f"{label}: device memory bandwidth not measured", None, {})
    gbps, sustained = memory["gbps"], memory.get("min_gbps", memory["gbps"])
    reference = memory_reference_gbps(gpu_name)
    details = {**memory, "reference_gbps": reference}
    head = f"{label}: device memory copies at {gbps:,.0f} GB/s (sustained minimum {sustained:,.0f})"
    if reference is None:
        return Finding(name, "info", f"{head}; no data-sheet memory bandwidth known for {gpu_name!r}", None, details)
    floor = MEMORY_FLOOR_SHARE * reference
    details.update(share=sustained / reference, floor_gbps=floor)
    head += f", {gbps / reference:.0%} of the data sheet's {reference:,.0f} GB/s"
    if sustained >= floor:
        return Finding(name, "ok", f"{head}; floor {floor:,.0f} GB/s ({MEMORY_FLOOR_SHARE:.0%})", None, details)
    details["failed_floor"] = "memory_floor_gbps"
    return Finding(name, "warn", f"{head}: below the floor of {floor:,.0f} GB/s ({MEMORY_FLOOR_SHARE:.0%} of the "
                   "data sheet's)", "check memory clocks and throttling (`nvidia-smi -q -d CLOCK,PERFORMANCE`) and "
                   "whether another process shares the GPU (`gpukit ls`)", details)


def judge_memory(label: str, name: str, probe: dict[str, Any], others: int) -> Finding:
    if others:
        return Finding(name, "info", f"{label}: allocatable memory not measured: {others} other process(es) use "
                       "this GPU, and taking its free memory could make them run out", None, {"other_processes": others})
    got, free = probe.get("allocatable_bytes"), probe.get("free_bytes_at_allocation")
    if got is None or not free:
        return Finding(name, "info", f"{label}: allocatable memory not measured", None, {})
    details = {"allocatable_bytes": got, "free_bytes": free, "share": got / free}
    words = f"{label}: {format_bytes(got)} allocatable of {format_bytes(free)} reported free ({got / free:.0%})"
    if got / free < ALLOCATABLE_OK and free - got > 2**30:
        return Finding(name, "warn", words, "another process may hold memory NVML does not show (a container "
                       "beside this one); `nvidia-smi` on the host shows all of them", details)
    return Finding(name, "ok", words, None, details)


def judge_errors(label: str, name: str, health: GpuHealth) -> Finding:
    details = {k: getattr(health, k) for k in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
                                               "retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")}
    if health.remapped_rows_failure:
        return Finding(name, "fail", f"{label}: a memory row remapping failed: the GPU's memory is damaged",
                       "take the GPU out of service and ask the vendor for a replacement", details)
    if health.ecc_uncorrected_volatile:
        return Finding(name, "fail", f"{label}: {health.ecc_uncorrected_volatile} uncorrected ECC error(s) since the "
                       "driver loaded: results computed on it may be wrong",
                       "drain the GPU and reset it (`nvidia-smi -r -i N`, or reboot)", details)
    pending = [what for what, on in (("pages waiting to be retired", health.retired_pages_pending),
                                     ("memory rows waiting to be remapped", health.remapped_rows_pending)) if on]
    if pending:
        return Finding(name, "warn", f"{label}: {' and '.join(pending)} at the next reset",
                       "reset the GPU (`nvidia-smi -r -i N`) or reboot when it is idle", details)
    if health.ecc_uncorrected_aggregate:
        return Finding(name, "warn", f"{label}: {health.ecc_uncorrected_aggregate} uncorrected ECC error(s) over "
                       "its life, none since the driver loaded", "watch it; replace the GPU if the count grows", details)
    if all(v is None for v in details.values()):
        return Finding(name, "info", f"{label}: ECC and memory retirement not reported (ECC off or unsupported)",
                       None, details)
    return Finding(name, "ok", f"{label}: no uncorrected ECC errors, no memory waiting to be retired", None, details)


def judge_nvml_facts(label: str, index: int, health: GpuHealth, under_load: dict[str, Any] | None) -> list[Finding]:
    """The verdicts that need only NVML: the PCIe link (as read under load, if it was) and memory errors."""
    return [judge_link(label, f"gpu{index}.pcie_link", health, under_load),
            judge_errors(label, f"gpu{index}.errors", health)]


def judge_gpu(label: str, index: int, gpu_name: str | None, health: GpuHealth, probe: dict[str, Any],
              others: int) -> list[Finding]:
    """Every verdict of one GPU's probe (see :mod:`gpukit.doctor._gpu_probe`)."""
    link, errors = judge_nvml_facts(label, index, health, probe["copies"].get("during"))
    return [
        link,
        judge_copies(label, f"gpu{index}.copy_bandwidth", health, probe["copies"]),
        judge_matmul(label, f"gpu{index}.matmul", gpu_name, probe["matmul"]),
        judge_device_memory(label, f"gpu{index}.memory_bandwidth", gpu_name, probe.get("device_memory")),
        judge_memory(label, f"gpu{index}.memory", probe, others),
        errors,
    ]


def judge_allreduce(result: dict[str, Any], healths: list[GpuHealth]) -> Finding:
    """All-reduce bus bandwidth, against the slowest GPU's PCIe link where NVML reports it."""
    bus = result["busbw_gbps"]
    peaks = [h.link_peak_gbps() for h in healths]
    known = [p for p in peaks if p is not None]
    details = {**result, "slowest_link_gbps": min(known) if known else None}
    words = f"all-reduce over {result['world']} GPUs ({result['backend']}): bus bandwidth {bus:.1f} GB/s"
    if known and bus < 0.25 * min(known):
        return Finding("gpus.allreduce", "warn",
                       f"{words}, under a quarter of the slowest PCIe link ({min(known):.1f} GB/s)",
                       "check NCCL_P2P_DISABLE / NCCL_IB_DISABLE settings, `nvidia-smi topo -m`, and whether "
                       "the GPUs sit behind different CPU sockets", details)
    return Finding("gpus.allreduce", "ok" if known else "info", words, None, details)

