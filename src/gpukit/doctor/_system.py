"""Versions, CPUs this process may use, and the GPU modes that change behaviour (MIG, persistence)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from gpukit._util.cpu import threads_that_fit, usable_cpu_count
from gpukit.devices import persistence_mode, unavailable_reason
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["check_versions", "check_cpus", "check_cpu_load", "check_mig", "check_persistence", "cgroup_cpu_limit",
           "versions"]

#: a 1-minute load this share of the usable CPUs means other work competes for them
_BUSY_SHARE = 0.75


def versions(ctx: DoctorContext) -> dict[str, str | None]:
    """Versions a bug report needs (``None``: not installed / no driver)."""
    cached = ctx.extra.get("versions")
    if cached is not None:  # the check and the report both ask; the metadata lookup scans site-packages
        return dict(cached)
    import gpukit

    try:
        from importlib.metadata import version

        nvml = version("nvidia-ml-py")
    except Exception:  # not installed, or metadata unreadable
        nvml = None
    found = {
        "gpukit": gpukit.__version__, "python": platform.python_version(), "torch": ctx.torch.version,
        "torch_cuda": ctx.torch.cuda, "nvidia_driver": ctx.driver_version, "nvidia_ml_py": nvml,
        "os": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
    }
    ctx.extra["versions"] = found
    return dict(found)


def check_versions(ctx: DoctorContext) -> list[Finding]:
    """One line with every version (always ``info``)."""
    v = versions(ctx)
    text = ", ".join(f"{k} {val}" for k, val in v.items() if val is not None)
    return [Finding("system.versions", "info", text, None, dict(v))]


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup quota allows (``cpu.max``, cgroup v2; ``cpu.cfs_quota_us``, v1); ``None``: no limit."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path(root, "cpu", "cpu.cfs_quota_us").read_text())
        period_us = int(Path(root, "cpu", "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def check_cpus(ctx: DoctorContext, cgroup_root: str = "/sys/fs/cgroup") -> list[Finding]:
    """CPU count against this process's affinity and the container's CPU quota (read under ``cgroup_root``)."""
    total = os.cpu_count() or 1
    usable = usable_cpu_count()
    quota = cgroup_cpu_limit(cgroup_root)
    details = {"cpu_count": total, "affinity": usable, "cgroup_quota_cpus": quota}
    threads = ctx.env.get("OMP_NUM_THREADS")
    if quota is not None and quota + 0.5 < usable:
        limit = max(1, int(quota))
        return [Finding("system.cpus", "warn",
                        f"the container's CPU quota is {quota:g} CPUs, but {usable} are in this process's affinity "
                        f"(os.cpu_count() {total}): torch threads and DataLoader workers sized by the CPU count "
                        "oversubscribe and get throttled",
                        f"export OMP_NUM_THREADS={limit} and use num_workers <= {max(0, limit - 1)} "
                        "(or raise the quota: docker --cpus)", details)]
    if usable < total:
        return [Finding("system.cpus", "info",
                        f"this process may use {usable} of {total} CPUs (affinity: taskset, SLURM --cpus-per-task, "
                        f"numactl); gpukit sizes DataLoader workers by these {usable}"
                        + (f"; OMP_NUM_THREADS={threads}" if threads else ""), None, details)]
    return [Finding("system.cpus", "ok", f"{usable} CPUs usable (os.cpu_count() {total}, affinity {usable})"
                    + (f"; OMP_NUM_THREADS={threads}" if threads else ""), None, details)]


def check_cpu_load(ctx: DoctorContext, loadavg: tuple[float, float, float] | None = None) -> list[Finding]:
    """Other work on the CPUs this process may use: torch's default of one thread per core then
    oversubscribes them (measured here: a one-process CPU run ~12x slower than with one thread per
    free core), and the data loader looks slow for a reason that is not the data."""
    try:
        load = loadavg if loadavg is not None else os.getloadavg()
    except OSError:
        return [Finding("system.load", "info", "the load average cannot be read here")]
    usable = usable_cpu_count()
    threads = ctx.env.get("OMP_NUM_THREADS")
    details = {"load_1m": load[0], "load_5m": load[1], "usable_cpus": usable, "omp_num_threads": threads}
    if load[0] < _BUSY_SHARE * usable:
        return [Finding("system.load", "ok", f"load {load[0]:.1f} on {usable} usable CPUs", None, details)]
    free = threads_that_fit(usable, load[0])
    if threads and threads.isdigit() and 0 < int(threads) <= free:  # already fits what is left
        return [Finding("system.load", "info", f"the CPUs are busy (load {load[0]:.1f} on {usable} usable CPUs); "
                        f"OMP_NUM_THREADS={threads} fits in what other work leaves free", None, details)]
    text = (f"the CPUs are busy: load {load[0]:.1f} (5 min: {load[1]:.1f}) on {usable} usable CPUs, so torch's "
            f"default of one thread per core ({'OMP_NUM_THREADS unset' if not threads else f'OMP_NUM_THREADS={threads}'}) "
            "oversubscribes them: CPU training and data loading slow down many times, whatever the data")
    fix = (f"use fewer threads for a CPU run: export OMP_NUM_THREADS={free} (or torch.set_num_threads({free})); "
           "`gpukit run` sets it per worker when unset; or run when the machine is quieter")
    return [Finding("system.load", "warn", text, fix, details)]


def check_mig(ctx: DoctorContext) -> list[Finding]:
    """MIG mode per GPU: enabled without instances leaves CUDA no device there."""
    findings = []
    for gpu in ctx.gpus:
        if not gpu.mig_enabled:
            continue
        details = {"index": gpu.index, "mig_devices": [m.uuid for m in gpu.mig_devices]}
        if not gpu.mig_devices:
            findings.append(Finding("gpu.mig", "warn", f"{gpu.label} is in MIG mode with no MIG instance: CUDA "
                                    "sees no device on it",
                                    f"create instances (`sudo nvidia-smi mig -i {gpu.index} -cgi 1g.10gb -C`, "
                                    f"profiles: `nvidia-smi mig -lgip`) or turn MIG off (`sudo nvidia-smi -i "
                                    f"{gpu.index} -mig 0`)", details))
        else:
            profiles = ", ".join(m.label.split(" MIG ", 1)[-1] for m in gpu.mig_devices)
            findings.append(Finding("gpu.mig", "info", f"{gpu.label} is in MIG mode: {profiles}; a process uses one "
                                    "MIG device (give each worker its own MIG- UUID)", None, details))
    if not findings:
        supported = [g for g in ctx.gpus if g.mig_enabled is not None]
        text = (f"MIG is off on every MIG-capable GPU ({len(supported)})" if supported
                else "no GPU here supports MIG" if ctx.gpus else "no NVIDIA GPU")
        findings.append(Finding("gpu.mig", "ok" if ctx.gpus else "info", text))
    return findings


def check_persistence(ctx: DoctorContext) -> list[Finding]:
    """Persistence mode per GPU (NVML): off means each start re-initialises the driver."""
    if not ctx.gpus or unavailable_reason() is not None:
        return [Finding("gpu.persistence", "info", "no NVIDIA GPU, so no persistence mode")]
    modes = {gpu.index: persistence_mode(gpu.index) for gpu in ctx.gpus}
    details = {"persistence_mode": {str(k): v for k, v in modes.items()}}
    off = [i for i, on in modes.items() if on is False]
    if off and sys.platform.startswith("linux"):
        listed = ",".join(map(str, off))
        return [Finding("gpu.persistence", "info",
                        f"persistence mode is off on GPU {listed}: the driver unloads between jobs, so each start "
                        "pays seconds of initialisation and GPU settings (clocks, power limit) reset",
                        f"sudo nvidia-smi -i {listed} -pm 1 (or enable the nvidia-persistenced service)", details)]
    if all(on is None for on in modes.values()):
        return [Finding("gpu.persistence", "info", "persistence mode is not reported by this driver", None, details)]
    return [Finding("gpu.persistence", "ok", "persistence mode is on on every GPU that reports it", None, details)]
