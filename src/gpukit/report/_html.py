"""The HTML report: one self-contained file (inline CSS and SVG, no script, no network)."""

from __future__ import annotations

import datetime as _dt
import html
import os
import statistics
from pathlib import Path
from gpukit._util.safe_files import write_user_file
from gpukit._util.units import format_bytes
from gpukit.report._charts import charts
from gpukit.report._lines import MAX_TEXT_CHARS, short
from gpukit.report._read import RunRecord, read_record
from gpukit.report._summary import RunSummary, summarize

__all__ = ["render_report", "write_report"]

_EVENT_ROWS = 500
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;color:#222;padding:0 24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666;margin-bottom:16px}.warn{background:#fff4e5;border-left:4px solid #ff7f0e;padding:8px 12px}
.straggler-note{background:#fdecea;border-left:4px solid #d62728;padding:8px 12px;font-weight:600}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 12px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600}tr.straggler td{background:#fdecea;font-weight:600}
td.num{text-align:right}.grid-charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}
figure.chart{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:6px 8px;background:#fff;min-width:0}
figure.chart svg{display:block;width:100%;height:auto}
figcaption{font-weight:600;margin-bottom:2px}.legend span{margin-right:12px;font-size:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
svg .grid{stroke:#eee}svg .frame{fill:none;stroke:#bbb}svg .tick,svg .axis{font-size:11px;fill:#555}
svg .series{stroke-linecap:round;stroke-linejoin:round}svg .area{fill-opacity:.75;stroke-width:.5}
svg .marker{stroke:#d62728;stroke-dasharray:3 3;stroke-width:1}.nodata{color:#888}
svg .run-start{stroke:#333;stroke-dasharray:6 3;stroke-width:1.2}svg .run-label{font-size:11px;fill:#333}
.notes li{margin:2px 0}
"""


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.3g} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min" if value < 7200 else f"{value / 3600:.1f} h"


def _listed(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit:,} more)" if len(items) > limit else "")


def _compute(summary: RunSummary) -> str:
    """Achieved TFLOP/s per device and MFU, from the ranks' ``mfu`` events (mean over the ranks that have them)."""
    from gpukit.monitor import format_flops

    figures = [r.flops for r in summary.ranks if r.flops is not None]
    if not figures:
        return "n/a (no epoch of a gpukit loader ended with a FLOP count)"
    achieved = statistics.fmean(f.achieved_tflops for f in figures)
    first = figures[0]
    text = (f"{format_flops(achieved)} per device (mean of {len(figures)} rank{'s' if len(figures) > 1 else ''}), "
            f"{first.flops_per_step:,} FLOPs per step ({first.flops_source or '?'})")
    mfus = [f.mfu for f in figures if f.mfu is not None]
    if mfus:
        return text + f"; MFU {100 * statistics.fmean(mfus):.3g}% of {first.peak_tflops:g} TFLOP/s ({first.peak_source})"
    return text + f"; MFU not known ({first.peak_source or 'no peak for this device'})"


def _summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    processes = f"{summary.world_size} process{'es' if summary.world_size != 1 else ''}"
    hosts = f" on {len(summary.hosts)} hosts" if len(summary.hosts) > 1 else ""
    runs = len(summary.runs)
    duration = _seconds(summary.duration_s) + ("" if summary.finished else " so far")
    if runs > 1:
        duration += f" in {runs} runs (first start to last line: {_seconds(summary.span_s)})"
    throughput = "n/a" if summary.samples_per_s is None else f"{summary.samples_per_s:,.1f} samples/s (all ranks)"
    if runs > 1 and summary.samples_per_s is not None:
        throughput += ", over the time the runs ran (gaps between runs left out)"
    rows = [("devices", f"{processes}{hosts}: " + _listed(summary.devices)),
            ("strategy", summary.strategy or "n/a"), ("precision", summary.precision or "n/a"),
            ("runs", _listed([f.info.label() for f in summary.runs], 6)),
            ("duration", duration), ("throughput", throughput)]
    if summary.time_split_pct:
        split = " · ".join(f"{name} {pct:.0f}%" for name, pct in summary.time_split_pct.items())
        rows.append(("where the time went", split + (" (estimated: steps not synchronised)" if summary.estimated_split else "")))
    else:
        rows.append(("where the time went", "no step timings recorded"))
    rows.append(("compute", _compute(summary)))
    peaks = []
    for r in summary.ranks[:8]:
        if r.peak_torch_allocated_bytes is not None or r.peak_gpu_mem_used_bytes is not None:
            peaks.append(f"rank {r.rank}: {format_bytes(r.peak_torch_allocated_bytes)} allocated, "
                         f"{format_bytes(r.peak_torch_reserved_bytes)} reserved, "
                         f"{format_bytes(r.peak_gpu_mem_used_bytes)} NVML used")
        elif r.peak_process_rss_bytes is not None:
            peaks.append(f"rank {r.rank}: {format_bytes(r.peak_process_rss_bytes)} process resident (CPU run)")
    more = f"; ... ({len(summary.ranks) - 8:,} more ranks in the table)" if peaks and len(summary.ranks) > 8 else ""
    rows.append(("peak memory", "; ".join(peaks) + more if peaks else "n/a"))
    rows.append(("events", _listed([f"{kind} x{count:,}" for kind, count in sorted(summary.events.items())], 12)
                 or "none"))
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
    total = sum(sum(r.event_kinds.values()) for r in record.ranks.values())
    if not events:
        return "<p>No events (OOM back-offs, leak warnings, checkpoints, preemption, restarts).</p>"
    rows = []
    for t, rank, e in events[:_EVENT_ROWS]:
        details = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("type", "t", "kind", "step"))
        rows.append(f"<tr><td>{_seconds(t - record.start_t)}</td><td>{rank}</td><td>{e.get('step')}</td>"
                    f"<td>{html.escape(str(e.get('kind')))}</td>"
                    f"<td>{html.escape(short(details, MAX_TEXT_CHARS * 2))}</td></tr>")
    more = f"<p>... and {total - len(rows):,} more (counted in the summary).</p>" if total > len(rows) else ""
    return ("<table><tr><th>time</th><th>rank</th><th>step</th><th>event</th><th>details</th></tr>"
            + "".join(rows) + "</table>" + more)


def _runs_table(summary: RunSummary, start_t: float) -> str:
    head = ("run", "started", "duration", "ranks", "steps (per rank)", "samples/s (all ranks)", "state")
    rows = []
    for f in summary.runs:
        info = f.info
        cells = (info.label(), f"+{_seconds(info.start_t - start_t)}" if info.index > 1 else _clock(info.start_t),
                 _seconds(info.duration_s), str(info.ranks), f"{f.steps:,}",
                 "n/a" if f.samples_per_s is None else f"{f.samples_per_s:,.1f}",
                 "finished" if info.finished else "stopped without closing, or in progress")
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return ("<table id=\"runs\"><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table>")


def _clock(t: float) -> str:
    return _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _notes(record: RunRecord) -> str:
    skipped = sum(r.skipped_lines for r in record.ranks.values())
    notes = list(record.notes)
    if skipped:
        notes.insert(0, f"{skipped:,} incomplete or unreadable line(s) skipped (a run still writing, or killed "
                        "mid-line; or lines that are not gpukit record lines)")
    if not notes:
        return ""
    shown = notes[:20] + ([f"... and {len(notes) - 20:,} more notes"] if len(notes) > 20 else [])
    return ('<div class="warn"><b>Read with limits:</b><ul class="notes">'
            + "".join(f"<li>{html.escape(short(n, 400))}</li>" for n in shown) + "</ul></div>")


def render_report(record: RunRecord) -> str:
    """The report of ``record`` as one HTML document (a string)."""
    summary = summarize(record)
    started = _clock(record.start_t)
    state = "finished" if summary.finished else "in progress, or stopped without closing (up to its last line)"
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>gpukit report: "
             f"{html.escape(str(record.directory))}</title><style>{_CSS}</style></head><body>",
             f"<h1>gpukit run report</h1><div class=\"sub\">{html.escape(str(record.directory))} · started "
             f"{started} · {html.escape(state)}</div>"]
    parts.append(_notes(record))
    if summary.straggler_note:
        parts.append(f'<p class="straggler-note" id="straggler">{html.escape(summary.straggler_note)}</p>')
    parts.append("<h2>Summary</h2><table id=\"summary\">" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(summary))
        + "</table>")
    parts.append("<h2>Runs</h2>" + _runs_table(summary, record.start_t))
    parts.append("<h2>Ranks</h2>" + _rank_table(summary))
    for title, figures in charts(record, summary):
        parts.append(f"<h2>{html.escape(title)}</h2><div class=\"grid-charts\">{''.join(figures)}</div>")
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
    try:
        # a fresh file renamed over the name: a browser reloading it never sees half a file, and a
        # symlink or FIFO planted at the name is replaced, never written through (safe_files)
        write_user_file(target, text.encode("utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"Cannot write the report to {str(target)!r}: {exc.strerror or exc}. "
                                 "Choose another file with --out.") from None
    return target
