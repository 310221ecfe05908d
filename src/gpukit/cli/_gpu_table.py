"""Rich rendering of GPU snapshots: nvidia-smi's two halves (GPUs, then processes)."""

from __future__ import annotations

from typing import Any, Mapping

from gpukit._units import format_bytes
from gpukit.devices import GpuSnapshot

__all__ = ["render_gpus", "gpu_table", "process_table"]


def _pct(value: int | None) -> str:
    return "n/a" if value is None else f"{value}%"


def _watts(draw: float | None, limit: float | None) -> str:
    if draw is None and limit is None:
        return "n/a"
    return f"{'n/a' if draw is None else f'{draw:.0f}'}/{'n/a' if limit is None else f'{limit:.0f}'} W"


def _memory(gpu: GpuSnapshot) -> str:
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    if used is None or total is None:
        return "n/a"
    return f"{used / 2**30:.1f} / {total / 2**30:.1f} GiB"


def _claim(gpu: GpuSnapshot, claims: Mapping[str, int | None]) -> str:
    if gpu.uuid is None or gpu.uuid not in claims:
        return ""
    pid = claims[gpu.uuid]
    return f"pid {pid}" if pid is not None else "yes"


def _util_style(util: int | None) -> str:
    if util is None:
        return "dim"
    return "red" if util >= 80 else "yellow" if util >= 30 else "green"


def _columns(wide: bool, with_claims: bool) -> list[tuple[str, str]]:
    cols = [("GPU", "right"), ("Name", "left")]
    cols += [("Bus-Id", "left")] if wide else []
    cols += [("Memory used/total", "right"), ("Free", "right"), ("Util", "right")]
    cols += [("Mem-Util", "right")] if wide else []
    cols += [("Temp", "right"), ("Power", "right")]
    cols += [("Mode", "left"), ("Procs", "right")] if wide else []
    cols += [("Claimed by", "left")] if with_claims else []
    return cols


def gpu_table(gpus: list[GpuSnapshot], claims: Mapping[str, int | None], *, wide: bool = True) -> Any:
    """The GPU half: one row per GPU, MIG devices indented beneath their GPU.

    ``wide=False`` (terminals under 120 columns) leaves out bus id, memory utilization,
    compute mode and process count, which ``--json`` always has.
    """
    from rich import box
    from rich.table import Table

    columns = _columns(wide, bool(claims))
    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "Name",  # type: ignore[arg-type]
                         min_width=12 if name == "Name" else None)
    names = [c for c, _ in columns]

    def row(**cells: str) -> None:
        table.add_row(*(cells.get(n, "") for n in names))

    for gpu in gpus:
        if not gpu.usable:
            row(**{"GPU": str(gpu.index), "Name": gpu.name or "?", "Bus-Id": gpu.pci_bus_id or "?",
                   "Memory used/total": f"[bold red]unusable: {gpu.error}[/]"})
            continue
        free_style = "green" if (gpu.memory_free_bytes or 0) > (gpu.memory_total_bytes or 1) / 2 else "yellow"
        row(**{
            "GPU": str(gpu.index), "Name": (gpu.name or "n/a") + (" [cyan](MIG)[/]" if gpu.mig_enabled else ""),
            "Bus-Id": gpu.pci_bus_id or "n/a", "Memory used/total": _memory(gpu),
            "Free": f"[{free_style}]{format_bytes(gpu.memory_free_bytes)}[/]",
            "Util": f"[{_util_style(gpu.utilization_gpu_pct)}]{_pct(gpu.utilization_gpu_pct)}[/]",
            "Mem-Util": _pct(gpu.utilization_memory_pct),
            "Temp": "n/a" if gpu.temperature_c is None else f"{gpu.temperature_c}C",
            "Power": _watts(gpu.power_draw_w, gpu.power_limit_w), "Mode": gpu.compute_mode or "n/a",
            "Procs": str(len(gpu.processes)), "Claimed by": _claim(gpu, claims),
        })
        for mig in gpu.mig_devices:
            profile = (mig.name or "").rsplit(" MIG ", 1)[-1]
            row(**{
                "GPU": f"{gpu.index}:{mig.gpu_instance_id}", "Name": f" └ MIG {profile} [dim]{mig.short_uuid}[/]",
                "Memory used/total": _memory(mig), "Free": format_bytes(mig.memory_free_bytes),
                "Util": _pct(mig.utilization_gpu_pct), "Procs": str(len(mig.processes)),
                "Claimed by": _claim(mig, claims),
            })
    return table


def process_table(gpus: list[GpuSnapshot]) -> Any:
    """The process half: GPU, pid, user, command, GPU memory."""
    from rich.table import Table

    from rich import box

    table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
    table.add_column("GPU", justify="right", no_wrap=True)
    table.add_column("PID", justify="right", no_wrap=True)
    table.add_column("User", no_wrap=True)
    table.add_column("Command", overflow="ellipsis", no_wrap=True, max_width=60)
    table.add_column("GPU memory", justify="right", no_wrap=True)
    rows = 0
    for gpu in gpus:
        units = [(str(gpu.index), gpu)] if not gpu.mig_devices else [
            (f"{gpu.index}:{m.gpu_instance_id}", m) for m in gpu.mig_devices]
        for where, unit in units:
            for proc in unit.processes:
                rows += 1
                table.add_row(where, str(proc.pid), proc.user or "[dim]n/a[/]", proc.command or "[dim]n/a[/]",
                              format_bytes(proc.used_memory_bytes))
    if rows == 0:
        table.add_row("", "", "", "[dim]no running processes found[/]", "")
    return table


def render_gpus(gpus: list[GpuSnapshot], claims: Mapping[str, int | None], header: str, *, width: int) -> Any:
    """Header line, GPU table, process table, as one renderable (for print or rich Live)."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(header, style="bold"), gpu_table(gpus, claims, wide=width >= 120), process_table(gpus))
