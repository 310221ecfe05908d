"""Rich rendering of GPU snapshots: nvidia-smi's two halves (GPUs, then processes).

Both tables fit the terminal: cells never wrap. The GPU table keeps its most useful columns
(index, name, memory, free, utilization, claims) and adds the others in order of use while
they fit; ``--json`` always has everything. The process table shortens long commands.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from gpukit._util.text import printable
from gpukit._util.units import format_bytes
from gpukit.devices import GpuSnapshot

__all__ = ["GpuHistory", "render_gpus", "gpu_table", "process_table", "sparkline", "claims_footer"]

_GAP = 2  # characters between two columns (one of padding, one of divider)
_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 16  # samples a sparkline shows

# a claim as `claim_holders` gives it (owner pid) or as `claim_owners` does (the owner's note)
Claim = Union[int, None, Mapping[str, Any]]


def sparkline(values: list[float | None], top: float = 100.0) -> str:
    """Unicode blocks, one per value in ``[0, top]`` (a gap for ``None``): ``▁▃▇█``."""
    out = []
    for value in values:
        if value is None:
            out.append(" ")
            continue
        level = min(len(_BLOCKS) - 1, max(0, int(value / top * len(_BLOCKS)))) if top > 0 else 0
        out.append(_BLOCKS[level])
    return "".join(out)


class GpuHistory:
    """The last ``length`` utilization and memory-use percentages of each GPU (``ls --watch``)."""

    def __init__(self, length: int = 120) -> None:
        self._util: dict[str, deque[float | None]] = {}
        self._mem: dict[str, deque[float | None]] = {}
        self._length = length

    @staticmethod
    def _key(gpu: GpuSnapshot) -> str:
        return gpu.uuid or str(gpu.index)

    def add(self, gpus: list[GpuSnapshot]) -> None:
        """Append one sample per GPU (and MIG device)."""
        for gpu in (u for g in gpus for u in (g, *g.mig_devices)):
            used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
            mem = None if used is None or not total else 100.0 * used / total
            for store, value in ((self._util, gpu.utilization_gpu_pct), (self._mem, mem)):
                store.setdefault(self._key(gpu), deque(maxlen=self._length)).append(value)

    def cells(self, gpu: GpuSnapshot, width: int = SPARK_WIDTH) -> tuple[str, str]:
        """The utilization and memory sparklines of ``gpu`` (its last ``width`` samples)."""
        key = self._key(gpu)
        return (sparkline(list(self._util.get(key, ()))[-width:]).ljust(width),
                sparkline(list(self._mem.get(key, ()))[-width:]).ljust(width))


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


def _free(num_bytes: int | None) -> str:
    """Free memory to the precision of the memory column: ``1.2 GiB``, ``306 MiB``."""
    if num_bytes is None:
        return "n/a"
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def _claim(gpu: GpuSnapshot, claims: Mapping[str, Claim]) -> str:
    """``pid 4242 (alice)``, or under ``gpukit run`` the run and rank: ``3f2a9c rank 1 · pid 4242 (alice)``."""
    if gpu.uuid is None or gpu.uuid not in claims:
        return ""
    owner = claims[gpu.uuid]
    if owner is None:
        return "yes"
    if not isinstance(owner, Mapping):
        return f"pid {owner}"
    if owner.get("blocked"):
        return f"blocked by {owner.get('user') or 'another user'}"
    if owner.get("pid") is None:
        return "yes"
    text = f"pid {owner.get('pid')}" + (f" ({owner['user']})" if owner.get("user") else "")
    if owner.get("rank") is not None:
        text = f"rank {owner['rank']} · {text}"
    if owner.get("run"):
        text = f"{str(owner['run']).removeprefix('gpukit-')[:6]} {text}"
    return text


def _util_style(util: int | None) -> str:
    if util is None:
        return "dim"
    return "red" if util >= 80 else "yellow" if util >= 30 else "green"


@dataclass
class _Column:
    name: str
    justify: str = "right"
    cells: list[tuple[str, str]] = field(default_factory=list)  # (plain text, style)

    def __post_init__(self) -> None:
        self.cells = [(printable(text), style) for text, style in self.cells]

    def add(self, text: str, style: str = "") -> None:
        """A cell; what another user wrote (a command, a run id) reaches the terminal escaped."""
        self.cells.append((printable(text), style))

    @property
    def width(self) -> int:
        return max([len(self.name)] + [len(text) for text, _ in self.cells])


# Display order, and the order in which columns are kept when the terminal is narrow.
_ORDER = ["GPU", "Name", "Bus-Id", "Memory used/total", "Free", "Util", "Util history", "Memory history",
          "Mem-Util", "Temp", "Power", "Mode", "Procs", "Claimed by"]
_PRIORITY = ["GPU", "Name", "Memory used/total", "Free", "Util", "Claimed by", "Util history", "Memory history",
             "Temp", "Power", "Procs", "Mem-Util", "Bus-Id", "Mode"]
_LEFT = {"Name", "Bus-Id", "Mode", "Claimed by", "Util history", "Memory history"}


def _rows(gpus: list[GpuSnapshot], claims: Mapping[str, Claim]) -> list[dict[str, tuple[str, str]]]:
    rows: list[dict[str, tuple[str, str]]] = []
    for gpu in gpus:
        if not gpu.usable:
            rows.append({"GPU": (str(gpu.index), ""), "Name": (gpu.name or "?", ""),
                         "Bus-Id": (gpu.pci_bus_id or "?", ""),
                         "Memory used/total": (f"unusable: {gpu.error}", "bold red")})
            continue
        half_free = (gpu.memory_free_bytes or 0) > (gpu.memory_total_bytes or 1) / 2
        rows.append({
            "GPU": (str(gpu.index), ""),
            "Name": ((gpu.name or "n/a") + (" (MIG)" if gpu.mig_enabled else ""), ""),
            "Bus-Id": (gpu.pci_bus_id or "n/a", ""),
            "Memory used/total": (_memory(gpu), ""),
            "Free": (_free(gpu.memory_free_bytes), "green" if half_free else "yellow"),
            "Util": (_pct(gpu.utilization_gpu_pct), _util_style(gpu.utilization_gpu_pct)),
            "Mem-Util": (_pct(gpu.utilization_memory_pct), ""),
            "Temp": ("n/a" if gpu.temperature_c is None else f"{gpu.temperature_c}C", ""),
            "Power": (_watts(gpu.power_draw_w, gpu.power_limit_w), ""),
            "Mode": (gpu.compute_mode or "n/a", ""),
            "Procs": (str(len(gpu.processes)), ""),
            "Claimed by": (_claim(gpu, claims), "bold"),
        })
        for mig in gpu.mig_devices:
            profile = (mig.name or "").rsplit(" MIG ", 1)[-1]
            rows.append({
                "GPU": (f"{gpu.index}:{mig.gpu_instance_id}", ""),
                "Name": (f" └ MIG {profile}", ""),
                "Bus-Id": (mig.short_uuid, "dim"),  # MIG devices are named by UUID, not bus id
                "Memory used/total": (_memory(mig), ""),
                "Free": (_free(mig.memory_free_bytes), ""),
                "Util": (_pct(mig.utilization_gpu_pct), ""),
                "Procs": (str(len(mig.processes)), ""),
                "Claimed by": (_claim(mig, claims), "bold"),
            })
    return rows


def _fit(columns: dict[str, _Column], width: int, required: list[str]) -> list[str]:
    """Column names to show, in display order: the required ones, then others while they fit."""
    chosen: list[str] = []
    used = -_GAP
    for name in required + [n for n in _PRIORITY if n not in required]:
        if name not in columns:
            continue
        extra = columns[name].width + _GAP
        if name in required or used + extra <= width:
            chosen.append(name)
            used += extra
    return [n for n in _ORDER if n in chosen]


def _table(columns: list[_Column], name_width: int | None = None) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, header_style="bold", show_edge=False, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for column in columns:
        shrink = column.name in ("Name", "Command")
        table.add_column(column.name, justify=column.justify,  # type: ignore[arg-type]
                         no_wrap=True, overflow="ellipsis",
                         min_width=None if shrink else column.width,
                         max_width=name_width if shrink else None)
    for i in range(len(columns[0].cells) if columns else 0):
        table.add_row(*(Text(c.cells[i][0], style=c.cells[i][1], no_wrap=True, overflow="ellipsis")
                        for c in columns))
    return table


_SPARK_MIN = 6  # a sparkline narrower than this shows no trend
_NAME_MIN = 8


def _spark_width(columns: dict[str, _Column], required: list[str], width: int) -> int:
    """Sparkline width so the required columns and both sparklines fit ``width`` (``ls --watch``)."""
    fixed = sum(columns[n].width + _GAP for n in required if n != "Name") + _NAME_MIN + 2 * _GAP
    return max(_SPARK_MIN, min(SPARK_WIDTH, (width - fixed) // 2))


def gpu_table(gpus: list[GpuSnapshot], claims: Mapping[str, Claim], *, width: int = 200,
              history: GpuHistory | None = None) -> Any:
    """The GPU half: one row per GPU, MIG devices indented beneath their GPU.

    Columns that do not fit in ``width`` characters are left out, least useful first (mode,
    bus id, memory utilization, process count, power, temperature); ``--json`` has them all.
    With ``history`` (``ls --watch``) the sparklines are kept (narrowed to fit, down to 6
    samples) before free memory, temperature and power: the trend is the point of watching.
    """
    rows = _rows(gpus, claims)
    names = [n for n in _ORDER if n not in ("Claimed by", "Util history", "Memory history")
             or any(r.get(n, ("", ""))[0] for r in rows)]
    columns = {n: _Column(n, "left" if n in _LEFT else "right", [r.get(n, ("", "")) for r in rows])
               for n in names}
    required = [n for n in ("GPU", "Name", "Memory used/total", "Free", "Util", "Claimed by") if n in columns]
    if history is not None:
        required = [n for n in required if n != "Free"]
        spark = _spark_width(columns, required, width)
        by_gpu = {id(g): history.cells(g, spark) for g in gpus}
        short = spark < len("Memory history")  # narrow: shorter headers, so the sparklines keep the room
        for name, header, part, style in (("Util history", "Util trend", 0, "cyan"),
                                          ("Memory history", "Mem trend", 1, "magenta")):
            cells = [(by_gpu[id(g)][part], style) if g.usable else ("", "") for g in gpus]
            columns[name] = _Column(header if short else name, "left", _align_to_rows(cells, gpus))
            required.append(name)
    shown = _fit(columns, width, required)
    others = sum(columns[n].width + _GAP for n in shown if n != "Name")
    return _table([columns[n] for n in shown], name_width=max(_NAME_MIN, width - others))


def _align_to_rows(cells: list[tuple[str, str]], gpus: list[GpuSnapshot]) -> list[tuple[str, str]]:
    """One cell per GPU -> one per table row (MIG devices get rows of their own, with no sparkline)."""
    out: list[tuple[str, str]] = []
    for cell, gpu in zip(cells, gpus):
        out.append(cell)
        out.extend(("", "") for _ in (gpu.mig_devices if gpu.usable else ()))
    return out


def process_table(gpus: list[GpuSnapshot], *, width: int = 200) -> Any:
    """The process half: GPU, pid, user, command (shortened to fit), GPU memory."""
    from rich.text import Text

    columns = {n: _Column(n, "left" if n in ("User", "Command") else "right")
               for n in ("GPU", "PID", "User", "Command", "GPU memory")}
    for gpu in gpus:
        units = [(str(gpu.index), gpu)] if not gpu.mig_devices else [
            (f"{gpu.index}:{m.gpu_instance_id}", m) for m in gpu.mig_devices]
        for where, unit in units:
            for proc in unit.processes:
                for name, cell in (("GPU", (where, "")), ("PID", (str(proc.pid), "")),
                                   ("User", (proc.user or "n/a", "" if proc.user else "dim")),
                                   ("Command", (proc.command or "n/a", "" if proc.command else "dim")),
                                   ("GPU memory", (format_bytes(proc.used_memory_bytes), ""))):
                    columns[name].add(*cell)
    if not columns["GPU"].cells:
        return Text("No processes are using the GPUs.", style="dim")
    others = sum(c.width + _GAP for n, c in columns.items() if n != "Command")
    return _table(list(columns.values()), name_width=max(12, width - others))


def claims_footer(state: Any) -> list[Any]:
    """The lines under the tables: the queue (user, GPUs wanted, waiting since), then what is wrong
    with the claims (stale or planted claims, blocked lock files), then the private-folder notice."""
    import time

    from rich.text import Text

    if state is None:
        return []
    out: list[Any] = []
    if state.queue:
        out.append(Text("Waiting for GPUs (first come, first served):", style="bold"))
        for position, ticket in enumerate(state.queue, 1):
            wanted = f"{ticket.count} GPU{'s' if ticket.count != 1 else ''}"
            since = time.strftime("%H:%M:%S", time.localtime(ticket.since))
            pid = f" · pid {ticket.pid}" if ticket.pid else ""
            run = f" · run {ticket.run}" if ticket.run else ""
            out.append(Text(printable(f"  {position}. {ticket.user} wants {wanted}, waiting since {since}{pid}{run}",
                                      max_chars=200), no_wrap=True, overflow="ellipsis"))
    for problem in state.problems:
        fix = f" -> {problem.fix}" if problem.fix else ""
        style = "yellow" if problem.severity == "warn" else "dim"
        out.append(Text(printable(f"! {problem.what}{fix}", max_chars=400), style=style))
    for line in (state.error, state.notice):
        if line:
            out.append(Text(printable(f"note: {line}", max_chars=600), style="dim"))
    return [Text(""), *out] if out else []


def render_gpus(gpus: list[GpuSnapshot], claims: Mapping[str, Claim], header: str, *, width: int,
                history: GpuHistory | None = None, hint: str = "", claim_state: Any = None) -> Any:
    """Header line, GPU table, process table, then the queue and claim problems, as one renderable
    (for print or rich Live).

    With ``history`` (``ls --watch``) the GPU table adds utilization and memory sparklines.
    ``hint`` (``" · Ctrl-C to stop"``) ends the header line whole: the header is shortened first.
    ``claim_state``: a :class:`gpukit.devices._claims_admin.ClaimState` for the lines at the end.
    """
    from rich.console import Group
    from rich.text import Text

    room = width - len(hint)
    header = printable(header)
    line = header if len(header) <= room else header[: max(0, room - 1)] + "…"
    return Group(Text(line + hint, style="bold", overflow="ellipsis", no_wrap=True), Text(""),
                 gpu_table(gpus, claims, width=width, history=history), Text(""), process_table(gpus, width=width),
                 *claims_footer(claim_state))
