"""What memory each device holds: NVML's view next to torch's allocator view.

``memory_report()`` answers "where did my memory go?" in one object that renders as a table,
a dict or JSON. ``show_utilization()`` is the familiar one-line-per-GPU view (what
``GPUtil.showUtilization()`` prints), read through gpukit's NVML layer.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Union

import torch

from gpukit._util.units import format_bytes
from gpukit.accelerators import get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.memory._live import live_tensor_bytes

__all__ = ["DeviceMemory", "MemoryReport", "memory_report", "show_utilization"]

DeviceLike = Union[str, int, torch.device]


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory. Every field is ``None`` where the source is not available.

    Attributes:
        device: torch device string, ``"cuda:0"`` or ``"cpu"``.
        name: GPU model name from NVML (``None`` for the CPU or without a driver).
        physical_index: NVML (nvidia-smi) index of this logical device.
        nvml_used_bytes / nvml_total_bytes: what nvidia-smi shows (all processes).
        allocated_bytes: bytes in live tensors, as torch's caching allocator counts them.
        reserved_bytes: bytes the caching allocator holds from the driver.
        reserved_unused_bytes: reserved but not allocated -- cache and fragmentation;
            ``free_memory()`` returns what it can of it.
        peak_allocated_bytes / peak_reserved_bytes: high-water marks since the last reset.
        alloc_retries: times the allocator had to free its cache and retry (a sign of pressure).
        num_ooms: out-of-memory errors torch raised on this device in this process.
        process_rss_bytes: resident memory of this process (CPU row).
        live_tensor_bytes: bytes of live CPU tensors Python can see (CPU row).
    """

    device: str
    name: str | None = None
    physical_index: int | None = None
    nvml_used_bytes: int | None = None
    nvml_total_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unused_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    num_ooms: int | None = None
    process_rss_bytes: int | None = None
    live_tensor_bytes: int | None = None


_COLUMNS: tuple[tuple[str, str], ...] = (
    ("device", "device"),
    ("nvml_used_bytes", "nvidia-smi used"),
    ("nvml_total_bytes", "total"),
    ("allocated_bytes", "allocated"),
    ("reserved_bytes", "reserved"),
    ("reserved_unused_bytes", "reserved unused"),
    ("peak_allocated_bytes", "peak allocated"),
    ("alloc_retries", "alloc retries"),
    ("num_ooms", "OOMs"),
    ("process_rss_bytes", "process RSS"),
    ("live_tensor_bytes", "live tensors"),
)


def _cell(row: DeviceMemory, field: str) -> str:
    value = getattr(row, field)
    if field == "device":
        return value if row.name is None else f"{value} ({row.name})"
    if value is None:
        return "-"
    return format_bytes(value) if field.endswith("_bytes") else str(value)


@dataclass(frozen=True)
class MemoryReport:
    """Memory of several devices; render with ``print(report)``, ``rich.print(report)``,
    ``report.to_dict()`` or ``report.to_json()``."""

    devices: tuple[DeviceMemory, ...]

    def __getitem__(self, device: str) -> DeviceMemory:
        for row in self.devices:
            if row.device == device:
                return row
        raise KeyError(f"{device!r} is not in this report; it has {[r.device for r in self.devices]}")

    def to_dict(self) -> dict[str, Any]:
        """``{"devices": [{field: value, ...}, ...]}`` with byte counts as ints."""
        return {"devices": [dataclasses.asdict(row) for row in self.devices]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _shown_columns(self) -> list[tuple[str, str]]:
        # drop columns that are empty for every device: a CPU-only report stays narrow
        return [(f, h) for f, h in _COLUMNS if f == "device" or any(getattr(r, f) is not None for r in self.devices)]

    def table(self) -> Any:
        """A ``rich.table.Table`` of this report."""
        from rich.table import Table

        table = Table(title="gpukit memory report")
        columns = self._shown_columns()
        for _, header in columns:
            table.add_column(header, justify="left" if header == "device" else "right")
        for row in self.devices:
            table.add_row(*(_cell(row, f) for f, _ in columns))
        return table

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        columns = self._shown_columns()
        rows = [[h for _, h in columns]] + [[_cell(r, f) for f, _ in columns] for r in self.devices]
        widths = [max(len(line[i]) for line in rows) for i in range(len(columns))]
        return "\n".join(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in rows
        )


def _normalise(devices: DeviceLike | Iterable[DeviceLike] | None) -> list[torch.device]:
    if devices is None:
        found = [torch.device("cpu")]
        # device_count() does not initialise CUDA, so a report never creates a context
        cuda = get_accelerator("cuda")
        if cuda.is_available():
            found += [cuda.device(i) for i in range(cuda.device_count())]
        return found
    if isinstance(devices, (str, int, torch.device)):
        items: Sequence[Any] = [devices]
    elif isinstance(devices, Iterable):
        items = list(devices)
    else:
        items = [devices]  # reported below as not a device
    result = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, int, torch.device)):
            raise ConfigurationError(
                f"memory_report(devices=...) got {item!r}; pass a device string ('cuda:0', 'cpu'), "
                "a CUDA index (0), a torch.device, or a list of them."
            )
        try:
            device = torch.device("cuda", item) if isinstance(item, int) else torch.device(item)
        except RuntimeError as exc:
            raise ConfigurationError(f"memory_report: {item!r} is not a device ({exc}); use e.g. 'cuda:0' or 'cpu'.") from None
        result.append(get_accelerator(device).with_index(device))  # an unsupported type: ConfigurationError
    return result


def memory_report(devices: DeviceLike | Iterable[DeviceLike] | None = None) -> MemoryReport:
    """Memory of each device, torch's counters next to what nvidia-smi shows.

    Never initialises CUDA: a device this process has not used reports ``None`` for torch's
    counters and still shows NVML's numbers.

    Args:
        devices: ``None`` for the CPU and every visible CUDA device, or one or several of
            ``"cuda:1"``, ``1``, ``torch.device(...)``, ``"cpu"``.

    Returns:
        A :class:`MemoryReport`.

    Raises:
        ConfigurationError: for something that is not a supported device.
    """
    rows = []
    for device in _normalise(devices):
        accelerator = get_accelerator(device)
        stats = accelerator.memory_stats(device)
        if accelerator.is_host:  # the process's memory and its live tensors
            rows.append(
                DeviceMemory(
                    device=device.type,
                    process_rss_bytes=stats.get("process_rss_bytes"),
                    live_tensor_bytes=live_tensor_bytes(device.type),
                )
            )
            continue
        allocated, reserved = stats.get("allocated_bytes"), stats.get("reserved_bytes")
        snapshot = accelerator.gpu_snapshot(device)  # NVML's view beside torch's counters (None: not NVML's)
        rows.append(
            DeviceMemory(
                device=str(device),
                name=getattr(snapshot, "name", None),
                physical_index=getattr(snapshot, "index", None),
                nvml_used_bytes=getattr(snapshot, "memory_used_bytes", None),
                nvml_total_bytes=getattr(snapshot, "memory_total_bytes", None),
                allocated_bytes=allocated,
                reserved_bytes=reserved,
                reserved_unused_bytes=None if allocated is None or reserved is None else reserved - allocated,
                peak_allocated_bytes=stats.get("peak_allocated_bytes"),
                peak_reserved_bytes=stats.get("peak_reserved_bytes"),
                alloc_retries=stats.get("alloc_retries"),
                num_ooms=stats.get("num_ooms"),
            )
        )
    return MemoryReport(devices=tuple(rows))


def show_utilization(file: IO[str] | None = None) -> str:
    """Print one line per GPU -- index, utilization, memory used/total -- like GPUtil.

    Reads NVML (every process's usage, physical nvidia-smi numbering); never initialises CUDA.

    Args:
        file: where to print; standard output by default.

    Returns:
        The text printed ("no GPU: ..." when there is no NVIDIA driver or GPU).
    """
    try:
        from gpukit.devices import list_gpus, silence_notice, unavailable_reason

        silence_notice()  # this view says "no GPU" itself: the notice would repeat it
        gpus = list_gpus()
    except Exception as exc:  # noqa: BLE001 - the view degrades to a message, never a traceback
        gpus = []
        reason = f"no GPU: NVML is not available ({type(exc).__name__}: {exc})"
    else:
        why = unavailable_reason()
        reason = f"no GPU: {why}" if why else "no GPU: no NVIDIA GPU or driver found"
    if not gpus:
        text = reason
    else:
        lines = ["| ID | GPU util | MEM util | memory used / total | name"]
        for gpu in gpus:
            util = "-" if gpu.utilization_gpu_pct is None else f"{gpu.utilization_gpu_pct:.0f}%"
            mem_pct = (
                "-"
                if not gpu.memory_total_bytes or gpu.memory_used_bytes is None
                else f"{100 * gpu.memory_used_bytes / gpu.memory_total_bytes:.0f}%"
            )
            lines.append(
                f"| {gpu.index:>2} | {util:>8} | {mem_pct:>8} | "
                f"{format_bytes(gpu.memory_used_bytes)} / {format_bytes(gpu.memory_total_bytes)} | {gpu.name}"
            )
        text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text
