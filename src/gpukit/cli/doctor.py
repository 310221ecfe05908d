"""``gpukit doctor``: check this machine for what breaks PyTorch GPU runs. Never imports torch."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["doctor", "format_report"]

_LABELS = {"ok": ("ok", "green"), "info": ("info", "blue"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "red")}


def _line(finding: Any) -> str:
    from gpukit._util.text import printable  # findings quote what others wrote (commands, notes, names)

    label, color = _LABELS[finding.status]
    head = click.style(f"{label:<4}", fg=color, bold=finding.status in ("warn", "fail"))
    fix = f"  -> fix: {printable(finding.fix)}" if finding.fix else ""
    return f"{head} {finding.name}: {printable(finding.message)}{fix}"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "n/a" if value is None else str(value)


def format_report(report: dict[str, Any]) -> str:
    """The report as ``key: value`` lines, like torch's collect_env, for pasting into a bug report."""
    from gpukit._util.units import format_bytes

    lines = [f"{k}: {_value(v)}" for k, v in report["versions"].items()]
    lines.append(f"NVML: {report['nvml']}")
    lines.append(f"GPUs: {len(report['gpus'])}")
    for g in report["gpus"]:
        mig = f", MIG on ({len(g['mig_devices'])} instances)" if g["mig_enabled"] else ""
        pm = {True: ", persistence on", False: ", persistence off"}.get(g["persistence_mode"], "")
        lines.append(f"  GPU {g['index']}: {g['name']} ({g['uuid']}, {g['pci_bus_id']}), "
                     f"{format_bytes(g['memory_total_bytes'])}, {g['processes']} process(es){mig}{pm}"
                     + ("" if g["usable"] else ", UNUSABLE"))
    cpus = report["cpus"]
    if cpus:
        lines.append(f"CPUs: {cpus.get('affinity')} usable of {cpus.get('cpu_count')} "
                     f"(cgroup quota: {_value(cpus.get('cgroup_quota_cpus'))})")
    shm = report["shm"]
    if "total_bytes" in shm:
        lines.append(f"shm: {shm['path']} {format_bytes(shm['total_bytes'])} ({format_bytes(shm['free_bytes'])} free)")
    lines.append("environment:" if report["environment"]
                 else "environment: (no CUDA/NCCL/GLOO/MASTER/GPUKIT variables)")
    lines.extend(f"  {k}={v}" for k, v in report["environment"].items())
    return "\n".join(lines)


@click.command("doctor", short_help="Check GPUs, driver, CUDA env, /dev/shm and network; say how to fix each.")
@click.option("--json", "as_json", is_flag=True, help="Print findings and report as one JSON object.")
@click.option("--shm-path", type=click.Path(exists=True, file_okay=False), default=None, metavar="DIR",
              help="Shared-memory filesystem to measure (default GPUKIT_SHM_PATH, else /dev/shm).")
@click.option("--gpu", "active", is_flag=True,
              help="Also measure each GPU (about 10 s each): copy bandwidth vs the PCIe link, a matrix product "
                   "vs the data sheet's peak, allocatable memory, ECC; an all-reduce between 2+ GPUs.")
def doctor(as_json: bool, shm_path: str | None, active: bool) -> int:
    """Check this machine for the traps that break PyTorch GPU runs, one line each with its fix.

    Checks: NVIDIA driver vs the CUDA torch was built with; CUDA_VISIBLE_DEVICES mapping and
    CUDA_DEVICE_ORDER; GPUs held by dead, defunct or orphaned processes and stale gpukit claims;
    MIG and persistence mode; CPUs and affinity; /dev/shm for DataLoader workers; the network
    interface, master address and rendezvous port of a multi-machine run. Then prints a report
    to paste into a bug report.

    With --gpu it then measures each GPU CUDA_VISIBLE_DEVICES leaves visible (skipping GPUs another
    gpukit job has claimed), each figure with its verdict, e.g. "matrix products at 41% of the
    peak: throttled for power".

    Exit status: 0 when no check failed (warnings allowed), 1 when one failed, 2 on bad input.
    """
    from gpukit._util.text import printable
    from gpukit.devices import silence_notice
    from gpukit.doctor import run_checks, worst

    silence_notice()  # the driver check says "no driver" in its own words
    result = run_checks(shm_path=shm_path, from_cli=True, shm_source="--shm-path" if shm_path else None)
    if active:
        from gpukit.doctor import run_gpu_checks

        say = (lambda text: click.echo(f"gpukit doctor: {text}", err=True))
        result.findings.extend(run_gpu_checks(progress=say))
    if as_json:
        click.echo(json.dumps(result.to_dict(), default=str))
        return result.exit_code
    for finding in result.findings:
        click.echo(_line(finding))
    counts = {s: sum(f.status == s for f in result.findings) for s in ("fail", "warn")}
    status = worst(result.findings)
    click.echo(f"\n{counts['fail']} failed, {counts['warn']} warning(s)" if status in ("fail", "warn")
               else "\nno problem found")
    click.echo("\n--- report (paste into a bug report) ---")
    click.echo(printable(format_report(result.report), keep_newlines=True))
    return result.exit_code
