"""Run every check, and assemble the report to paste into a bug report."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from gpukit._util.envvars import FAKE_GPUS_ENV
from gpukit.doctor._claims import check_claims
from gpukit.doctor._cluster import check_cluster
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._cuda import check_cuda_initialized, check_device_order, check_visible_devices
from gpukit.doctor._driver import check_driver
from gpukit.doctor._finding import Finding, worst
from gpukit.doctor._network import check_interface, check_master, check_port
from gpukit.doctor._processes import check_gpu_processes
from gpukit.doctor._shm import check_shm
from gpukit.doctor._system import check_cpu_load, check_cpus, check_mig, check_persistence, check_versions, versions

__all__ = ["CHECKS", "DoctorResult", "run_checks", "build_report"]

Check = Callable[[DoctorContext], list[Finding]]

#: every check, in the order it is printed
CHECKS: tuple[tuple[str, Check], ...] = (
    ("system.versions", check_versions),
    ("driver.cuda", check_driver),
    ("cuda.visible_devices", check_visible_devices),
    ("cuda.device_order", check_device_order),
    ("cuda.initialized", check_cuda_initialized),
    ("gpu.processes", check_gpu_processes),
    ("gpu.claims", check_claims),
    ("gpu.mig", check_mig),
    ("gpu.persistence", check_persistence),
    ("system.cpus", check_cpus),
    ("system.load", check_cpu_load),
    ("system.shm", check_shm),
    ("cluster.environment", check_cluster),
    ("network.interface", check_interface),
    ("network.master", check_master),
    ("network.port", check_port),
)

# environment variables worth showing in a bug report (values of others may be secrets)
_REPORT_ENV = re.compile(r"^(CUDA_|NCCL_|GLOO_|MASTER_|GPUKIT_|TORCH_|OMP_NUM_THREADS$|WORLD_SIZE$|RANK$|"
                         r"LOCAL_RANK$|LOCAL_WORLD_SIZE$|NODE_RANK$|SLURM_(JOB_ID|JOB_NODELIST|NTASKS|PROCID|"
                         r"LOCALID|NODEID|STEP_GPUS|JOB_GPUS|GPUS_ON_NODE|CPUS_PER_TASK)$|PYTORCH_)")


@dataclass(frozen=True)
class DoctorResult:
    """What :func:`run_checks` found.

    Attributes:
        findings: one or more :class:`Finding` per check, in :data:`CHECKS` order.
        report: collect_env-style facts (versions, GPUs, CPUs, environment) for a bug report.
    """

    findings: list[Finding]
    report: dict[str, Any]

    @property
    def failed(self) -> list[Finding]:
        """The findings with status ``"fail"``."""
        return [f for f in self.findings if f.status == "fail"]

    @property
    def exit_code(self) -> int:
        """``gpukit doctor``'s exit status: 1 when a check failed, else 0."""
        return 1 if self.failed else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"status", "findings": [...], "report": {...}}``."""
        return {"status": worst(self.findings), "findings": [f.to_dict() for f in self.findings],
                "report": self.report}


def _guarded(name: str, check: Check, ctx: DoctorContext) -> list[Finding]:
    try:
        return check(ctx)
    except Exception as exc:  # a broken check must not hide the others' findings
        return [Finding(name, "warn", f"the check itself failed: {type(exc).__name__}: {exc}",
                        "please report this as a gpukit bug, with this output")]


def build_report(ctx: DoctorContext, findings: list[Finding]) -> dict[str, Any]:
    """The facts behind the findings, for a bug report (no secrets: only known variable families)."""
    details = {f.name: f.details for f in findings}
    gpus = [{"index": g.index, "name": g.name, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id,
             "memory_total_bytes": g.memory_total_bytes, "memory_used_bytes": g.memory_used_bytes,
             "mig_enabled": g.mig_enabled, "mig_devices": [m.uuid for m in g.mig_devices],
             "persistence_mode": details.get("gpu.persistence", {}).get("persistence_mode", {}).get(str(g.index)),
             "processes": len(g.processes), "usable": g.usable}
            for g in ctx.gpus]
    report: dict[str, Any] = {
        "versions": versions(ctx),
        "torch_imported": ctx.torch.imported,
        "nvml": ctx.nvml_reason or (f"fake GPUs ({ctx.env[FAKE_GPUS_ENV]})" if ctx.env.get(FAKE_GPUS_ENV)
                                    else "ok"),
        "gpus": gpus,
        "cpus": details.get("system.cpus", {}),
        "shm": details.get("system.shm", {}),
        "cluster": details.get("cluster.environment", {}),
        "network": {k: v for k, v in (("interface", details.get("network.interface")),
                                       ("master", details.get("network.master")),
                                       ("port", details.get("network.port"))) if v},
        "environment": {k: v for k, v in sorted(ctx.env.items()) if _REPORT_ENV.match(k)},
    }
    return report


def run_checks(*, env: Mapping[str, str] | None = None, shm_path: str | os.PathLike[str] | None = None,
               from_cli: bool = False, shm_source: str | None = None) -> DoctorResult:
    """Check this machine and process for the traps that break PyTorch GPU runs.

    Never imports torch (an already imported torch is asked whether CUDA is initialised) and
    never initialises CUDA. Takes about a second; the slowest parts are bounded by timeouts
    (host name resolution 2 s, a TCP probe of a remote master 1 s).

    Args:
        env: the environment to judge (default ``os.environ``).
        shm_path: the shared-memory filesystem to measure (default ``GPUKIT_SHM_PATH``, else
            ``/dev/shm``).
        from_cli: set by ``gpukit doctor``: a fresh process, whose CUDA state says nothing.
        shm_source: how findings name ``shm_path`` (``"--shm-path"``; default ``"shm_path"``).

    Returns:
        A :class:`DoctorResult`: ``findings`` (each with ``status`` ok/info/warn/fail, ``message``
        and a one-line ``fix``) and a ``report`` dict; ``exit_code`` is 1 when a check failed.

    Raises:
        FakeSpecError: ``GPUKIT_FAKE_GPUS`` names a missing or malformed spec.
    """
    ctx = DoctorContext.gather(env=env, from_cli=from_cli, shm_path=shm_path, shm_source=shm_source)
    findings = [f for name, check in CHECKS for f in _guarded(name, check, ctx)]
    return DoctorResult(findings, build_report(ctx, findings))
