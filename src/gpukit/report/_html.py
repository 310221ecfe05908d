"""The HTML report: one self-contained file (inline CSS and SVG, no script, no network)."""

from __future__ import annotations

import datetime as _dt
import html
import os
from pathlib import Path
from typing import Any, Callable

from gpukit._util.units import format_bytes
from gpukit.report._read import RankRecord, RunRecord, read_record
from gpukit.report._summary import RunSummary, summarize
from gpukit.report._svg import Series, chart

__all__ = ["render_report", "write_report"]

_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
            "#ff7f0e", "#aec7e8"]
_STRAGGLER = "#d62728"
_SPLIT = (("data_s", "data wait", "#ff7f0e"), ("h2d_s", "host-to-device copy", "#9467bd"),
          ("compute_s", "compute", "#1f77b4"))
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1320px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666;margin-bottom:16px}.warn{background:#fff4e5;border-left:4px solid #ff7f0e;padding:8px 12px}
.straggler-note{background:#fdecea;border-left:4px solid #d62728;padding:8px 12px;font-weight:600}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 12px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600}tr.straggler td{background:#fdecea;font-weight:600}
td.num{text-align:right}.grid-charts{display:flex;flex-wrap:wrap;gap:12px}
figure.chart{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:6px 8px;background:#fff}
figcaption{font-weight:600;margin-bottom:2px}.legend span{margin-right:12px;font-size:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
svg .grid{stroke:#eee}svg .frame{fill:none;stroke:#bbb}svg .tick,svg .axis{font-size:11px;fill:#555}
svg .series{stroke-linecap:round;stroke-linejoin:round}svg .area{fill-opacity:.75;stroke-width:.5}
svg .marker{stroke:#d62728;stroke-dasharray:3 3;stroke-width:1}.nodata{color:#888;width:600px}
"""


def _color(rank: int, summary: RunSummary) -> str:
    return _STRAGGLER if rank == summary.straggler else _PALETTE[rank % len(_PALETTE)]


def _rank_series(summary: RunSummary, record: RunRecord, name: str,
                 points: Callable[[RankRecord], tuple[list[float], list[float | None]]]) -> list[Series]:
    out = []
    for rank, r in record.ranks.items():
        xs, ys = points(r)
        straggler = rank == summary.straggler
        out.append(Series(f"rank {rank}{' (straggler)' if straggler else ''}", xs, ys, _color(rank, summary),
                          width=2.6 if straggler else 1.4))
    return out


def _step_x(line: dict[str, Any]) -> float:
    return line["step"] + (line.get("n", 1) - 1) / 2


def _shown_ranks(record: RunRecord, summary: RunSummary, limit: int = 4) -> list[int]:
    ranks = list(record.ranks)
    if len(ranks) <= limit:
        return ranks
    chosen = [ranks[0]] + ([summary.straggler] if summary.straggler not in (None, ranks[0]) else [])
    return chosen + [r for r in ranks if r not in chosen][: limit - len(chosen)]


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.3g} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def _charts(record: RunRecord, summary: RunSummary) -> list[tuple[str, list[str]]]:
    t0 = record.start_t
    markers = [(e["t"] - t0, f"{e.get('kind')} (rank {r.rank})") for r in record.ranks.values() for e in r.events]
    sections: list[tuple[str, list[str]]] = []
    names = sorted({k for r in record.ranks.values() for s in r.steps for k in (s.get("scalars") or {})},
                   key=lambda n: (n != "loss", n))
    sections.append(("Logged scalars (session.log)", [
        chart(_rank_series(summary, record, name, lambda r, n=name: (
            [_step_x(s) for s in r.steps], [(s.get("scalars") or {}).get(n) for s in r.steps])),
            title=name, x_label="step", y_min=None)
        for name in names] or [chart([], title="loss", x_label="step")]))
    ms = lambda v: f"{v * 1000:.3g} ms"  # noqa: E731
    step_charts = [
        chart(_rank_series(summary, record, "step", lambda r: (
            [_step_x(s) for s in r.steps], [s.get("step_s") for s in r.steps])),
            title="Step time per rank", x_label="step", y_format=ms),
        chart(_rank_series(summary, record, "throughput", lambda r: (
            [_step_x(s) for s in r.steps],
            [s["samples"] / s["step_s"] / s.get("n", 1) if s.get("step_s") and s.get("samples") else None
             for s in r.steps])),
            title="Throughput per rank (samples/s)", x_label="step"),
    ]
    for rank in _shown_ranks(record, summary):
        r = record.ranks[rank]
        series = [Series(label, [_step_x(s) for s in r.steps], [s.get(key) for s in r.steps], color)
                  for key, label, color in _SPLIT if any(s.get(key) is not None for s in r.steps)]
        tag = " — straggler" if rank == summary.straggler else ""
        step_charts.append(chart(series, title=f"Where step time went, rank {rank}{tag}", x_label="step",
                                 y_format=ms, stacked=True))
    sections.append(("Steps", step_charts))
    use_gpu = any("gpu_util_pct" in s for r in record.ranks.values() for s in r.samples)
    util_key = "gpu_util_pct" if use_gpu else "cpu_pct"
    util_title = "GPU utilization (%)" if use_gpu else "CPU utilization of the process (%, 100 per core; no GPU)"
    system = [chart(_rank_series(summary, record, util_key, lambda r: (
        [s["t"] - t0 for s in r.samples], [s.get(util_key) for s in r.samples])),
        title=util_title, x_label="seconds since start", markers=markers,
        y_max=100.0 if use_gpu else None)]
    for rank in _shown_ranks(record, summary):
        r = record.ranks[rank]
        xs = [s["t"] - t0 for s in r.samples]
        series = [Series(label, xs, [s.get(key) for s in r.samples], color, dash=dash)
                  for key, label, color, dash in (
                      ("gpu_mem_used_bytes", "NVML used (whole GPU)", "#d62728", None),
                      ("torch_reserved_bytes", "torch reserved", "#9467bd", "5 3"),
                      ("torch_allocated_bytes", "torch allocated", "#1f77b4", None),
                      ("process_rss_bytes", "process resident (host)", "#7f7f7f", "2 2"))
                  if any(s.get(key) is not None for s in r.samples)]
        system.append(chart(series, title=f"Memory, rank {rank}", x_label="seconds since start",
                            y_bytes=True, markers=markers))
    sections.append(("Device and host", system))
    return sections


def _summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    processes = f"{summary.world_size} process{'es' if summary.world_size != 1 else ''}"
    hosts = f" on {len(summary.hosts)} hosts" if len(summary.hosts) > 1 else ""
    rows = [("devices", f"{processes}{hosts}: " + ", ".join(summary.devices)),
            ("strategy", summary.strategy or "n/a"), ("precision", summary.precision or "n/a"),
            ("duration", _seconds(summary.duration_s) + ("" if summary.finished else " so far")),
            ("throughput", "n/a" if summary.samples_per_s is None else f"{summary.samples_per_s:,.1f} samples/s (all ranks)")]
    if summary.time_split_pct:
        split = " · ".join(f"{name} {pct:.0f}%" for name, pct in summary.time_split_pct.items())
        rows.append(("where the time went", split + (" (estimated: steps not synchronised)" if summary.estimated_split else "")))
    else:
        rows.append(("where the time went", "no step timings recorded"))
    peaks = []
    for r in summary.ranks:
        if r.peak_torch_allocated_bytes is not None or r.peak_gpu_mem_used_bytes is not None:
            peaks.append(f"rank {r.rank}: {format_bytes(r.peak_torch_allocated_bytes)} allocated, "
                         f"{format_bytes(r.peak_torch_reserved_bytes)} reserved, "
                         f"{format_bytes(r.peak_gpu_mem_used_bytes)} NVML used")
        elif r.peak_process_rss_bytes is not None:
            peaks.append(f"rank {r.rank}: {format_bytes(r.peak_process_rss_bytes)} process resident (CPU run)")
    rows.append(("peak memory", "; ".join(peaks) or "n/a"))
    rows.append(("events", ", ".join(f"{kind} x{count}" for kind, count in sorted(summary.events.items())) or "none"))
    if summary.restarts:
        rows.append(("restarts", str(summary.restarts)))
    return rows


def _rank_table(summary: RunSummary) -> str:
    head = ("rank", "device", "steps", "median step", "samples/s", "data", "copy", "compute", "mean util")
    rows = []
    for r in summary.ranks:
        pct = [f"{100 * r.time_split_s[k] / r.busy_s:.0f}%" if r.busy_s and k in r.time_split_s else "n/a"
               for k in ("data_s", "h2d_s", "compute_s")]
        util = "n/a" if r.mean_util_pct is None else f"{r.mean_util_pct:.0f}% {r.util_source}"
        cells = (str(r.rank), r.device or "?", f"{r.steps:,}",
                 "n/a" if r.median_step_s is None else _seconds(r.median_step_s),
                 "n/a" if r.samples_per_s is None else f"{r.samples_per_s:,.1f}", *pct, util)
        cls = ' class="straggler"' if r.rank == summary.straggler else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>")


def _events_table(record: RunRecord) -> str:
    events = sorted(((e["t"], r.rank, e) for r in record.ranks.values() for e in r.events), key=lambda x: x[0])
    if not events:
        return "<p>No events (OOM back-offs, leak warnings, checkpoints, preemption, restarts).</p>"
    rows = []
    for t, rank, e in events[:500]:
        details = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("type", "t", "kind", "step"))
        rows.append(f"<tr><td>{t - record.start_t:.1f} s</td><td>{rank}</td><td>{e.get('step')}</td>"
                    f"<td>{html.escape(str(e.get('kind')))}</td><td>{html.escape(details)}</td></tr>")
    more = f"<p>... and {len(events) - 500} more.</p>" if len(events) > 500 else ""
    return ("<table><tr><th>time</th><th>rank</th><th>step</th><th>event</th><th>details</th></tr>"
            + "".join(rows) + "</table>" + more)


def render_report(record: RunRecord) -> str:
    """The report of ``record`` as one HTML document (a string)."""
    summary = summarize(record)
    started = _dt.datetime.fromtimestamp(record.start_t).strftime("%Y-%m-%d %H:%M:%S")
    state = "finished" if summary.finished else "in progress, or stopped without closing (up to its last line)"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>gpukit report: "
             f"{html.escape(str(record.directory))}</title><style>{_CSS}</style></head><body>",
             f"<h1>gpukit run report</h1><div class=\"sub\">{html.escape(str(record.directory))} · started "
             f"{started} · {html.escape(state)}</div>"]
    skipped = sum(r.skipped_lines for r in record.ranks.values())
    if skipped:
        parts.append(f'<p class="warn">{skipped} incomplete or unreadable line(s) skipped '
                     "(a run still writing, or killed mid-line).</p>")
    if summary.straggler_note:
        parts.append(f'<p class="straggler-note" id="straggler">{html.escape(summary.straggler_note)}</p>')
    parts.append("<h2>Summary</h2><table id=\"summary\">" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(summary))
        + "</table>")
    parts.append("<h2>Ranks</h2>" + _rank_table(summary))
    for title, charts in _charts(record, summary):
        parts.append(f"<h2>{html.escape(title)}</h2><div class=\"grid-charts\">{''.join(charts)}</div>")
    parts.append("<h2>Events</h2>" + _events_table(record))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Read the record in ``directory`` and write its HTML report.

    Args:
        directory: a run record directory (a run still in progress is fine).
        out: the HTML file; default ``<directory>/report.html``.

    Returns:
        The path written.

    Raises:
        ConfigurationError: no readable record in ``directory``, or ``out`` cannot be written.
    """
    from gpukit.errors import ConfigurationError

    text = render_report(read_record(directory))
    target = Path(out) if out is not None else Path(directory) / "report.html"
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)  # a browser reloading it never sees half a file
    except OSError as exc:
        raise ConfigurationError(f"Cannot write the report to {str(target)!r}: {exc.strerror or exc}. "
                                 "Choose another file with --out.") from None
    return target
