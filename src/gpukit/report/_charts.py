"""The report's charts: which series each plot holds, one path segment per run.

A record may hold several runs (see :mod:`._read`): every line is drawn as one segment per
run, so a rerun never joins the previous run's last point to its own first. On step axes each
run is placed after the runs before it (its :attr:`RunInfo.step_offset`: every process counts
its steps from 0), with a labelled line where it starts ("run 3", resumed or not in the runs
table and the line's tooltip). Per-rank lines are drawn for at most
:data:`MAX_RANK_LINES` ranks (the first ones and the straggler); the rank table lists them all.
"""

from __future__ import annotations

from typing import Any, Callable

from gpukit.report._lines import short
from gpukit.report._read import RankRecord, RunInfo, RunRecord
from gpukit.report._summary import RunSummary
from gpukit.report._svg import Series, chart

__all__ = ["MAX_RANK_LINES", "MAX_SCALAR_CHARTS", "charts", "shown_ranks"]

MAX_RANK_LINES = 16
MAX_SCALAR_CHARTS = 24
_PALETTE = ["#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
            "#ff7f0e", "#aec7e8"]
_STRAGGLER = "#d62728"
_SPLIT = (("data_s", "data wait", "#ff7f0e"), ("h2d_s", "host-to-device copy", "#9467bd"),
          ("compute_s", "compute", "#1f77b4"))
_MEMORY = (("gpu_mem_used_bytes", "NVML used (whole GPU)", "#d62728", None),
           ("torch_reserved_bytes", "torch reserved", "#9467bd", "5 3"),
           ("torch_allocated_bytes", "torch allocated", "#1f77b4", None),
           ("process_rss_bytes", "process resident (host)", "#7f7f7f", "2 2"))
Line = dict[str, Any]


def shown_ranks(record: RunRecord, summary: RunSummary, limit: int) -> list[int]:
    """The first ``limit`` ranks, with the straggler among them."""
    ranks = list(record.ranks)
    if len(ranks) <= limit:
        return ranks
    chosen = [ranks[0]] + ([summary.straggler] if summary.straggler not in (None, ranks[0]) else [])
    return chosen + [r for r in ranks if r not in chosen][: limit - len(chosen)]


def _step_points(record: RunRecord, r: RankRecord, value: Callable[[Line], float | None]
                 ) -> tuple[list[float | None], list[float | None]]:
    """(x, y) of each step line, x at the middle of the steps it holds; a break between runs."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for k, run in enumerate(r.runs):
        if xs and run.steps:
            xs.append(None)
            ys.append(None)
        offset = record.runs[k].step_offset
        for s in run.steps:
            xs.append(s["step"] + (s["n"] - 1) / 2 + offset)
            ys.append(value(s))
    return xs, ys


def _time_points(record: RunRecord, r: RankRecord, value: Callable[[Line], float | None]
                 ) -> tuple[list[float | None], list[float | None]]:
    xs: list[float | None] = []
    ys: list[float | None] = []
    for run in r.runs:
        if xs and run.samples:
            xs.append(None)
            ys.append(None)
        for s in run.samples:
            xs.append(s["t"] - record.start_t)
            ys.append(value(s))
    return xs, ys


def _run_starts(record: RunRecord, on_steps: bool) -> list[tuple[float, str]]:
    if len(record.runs) < 2:
        return []
    out = []
    for k, info in enumerate(record.runs[1:], start=1):
        if on_steps:
            firsts = [r.runs[k].steps[0]["step"] for r in record.ranks.values() if len(r.runs) > k and r.runs[k].steps]
            if not firsts:
                continue
            out.append((min(firsts) + info.step_offset, _run_tag(info)))
        else:
            out.append((info.start_t - record.start_t, _run_tag(info)))
    return out


def _run_tag(info: RunInfo) -> str:
    return f"run {info.index}" + (" (resumed)" if info.resumed_step is not None else "")


class _Charts:
    def __init__(self, record: RunRecord, summary: RunSummary) -> None:
        self.record, self.summary = record, summary
        self.ranks = shown_ranks(record, summary, MAX_RANK_LINES)
        self.detail_ranks = shown_ranks(record, summary, 4)
        runs = len(record.runs) > 1
        self.step_label = "step (runs drawn one after another)" if runs else "step"
        self.time_label = "time since the first run started" if runs else "time since start"
        self.step_starts = _run_starts(record, on_steps=True)
        self.time_starts = _run_starts(record, on_steps=False)

    def color(self, rank: int) -> str:
        return _STRAGGLER if rank == self.summary.straggler else _PALETTE[rank % len(_PALETTE)]

    def per_rank(self, points: Callable[[RankRecord], tuple[list, list]]) -> list[Series]:
        out = []
        for rank in self.ranks:
            xs, ys = points(self.record.ranks[rank])
            straggler = rank == self.summary.straggler
            out.append(Series(f"rank {rank}{' (straggler)' if straggler else ''}", xs, ys, self.color(rank),
                              width=2.6 if straggler else 1.4))
        return out

    def step_chart(self, series: list[Series], title: str, **options: Any) -> str:
        return chart(series, title=title, x_label=self.step_label, run_starts=self.step_starts, **options)

    def scalars(self) -> list[str]:
        names = sorted({n for r in self.record.ranks.values() for n in r.scalar_names}, key=lambda n: (n != "loss", n))
        out = [self.step_chart(self.per_rank(lambda r, n=name: _step_points(
            self.record, r, lambda s: (s.get("scalars") or {}).get(n))), short(name, 60), y_min=None)
            for name in names[:MAX_SCALAR_CHARTS]]
        return out or [chart([], title="loss", x_label="step")]

    def steps(self) -> list[str]:
        out = [
            self.step_chart(self.per_rank(lambda r: _step_points(self.record, r, lambda s: s["step_s"])),
                            "Step time per rank", y_kind="seconds"),
            self.step_chart(self.per_rank(lambda r: _step_points(self.record, r, lambda s: (
                s["samples"] / s["step_s"] / s["n"] if s["step_s"] and s["samples"] else None))),
                "Throughput per rank (samples/s)"),
        ]
        for rank in self.detail_ranks:
            r = self.record.ranks[rank]
            series = [Series(label, *_step_points(self.record, r, lambda s, k=key: s.get(k)), color)
                      for key, label, color in _SPLIT if any(s.get(key) is not None for s in r.steps)]
            tag = " — straggler" if rank == self.summary.straggler else ""
            out.append(self.step_chart(series, f"Where step time went, rank {rank}{tag}", y_kind="seconds",
                                       stacked=True))
        return out

    def system(self) -> list[str]:
        record = self.record
        markers = [(e["t"] - record.start_t, f"{e['kind']} (rank {r.rank})")
                   for r in record.ranks.values() for e in r.events]
        use_gpu = any("gpu_util_pct" in s for r in record.ranks.values() for s in r.samples)
        key = "gpu_util_pct" if use_gpu else "cpu_pct"
        title = "GPU utilization (%)" if use_gpu else "CPU utilization of the process (%, 100 per core; no GPU)"
        out = [chart(self.per_rank(lambda r: _time_points(record, r, lambda s: s.get(key))), title=title,
                     x_label=self.time_label, x_kind="seconds", markers=markers, run_starts=self.time_starts,
                     y_max=100.0 if use_gpu else None)]
        for rank in self.detail_ranks:
            r = record.ranks[rank]
            series = [Series(label, *_time_points(record, r, lambda s, k=field: s.get(k)), color, dash=dash)
                      for field, label, color, dash in _MEMORY if any(s.get(field) is not None for s in r.samples)]
            out.append(chart(series, title=f"Memory, rank {rank}", x_label=self.time_label, x_kind="seconds",
                             y_kind="bytes", markers=markers, run_starts=self.time_starts))
        return out


def charts(record: RunRecord, summary: RunSummary) -> list[tuple[str, list[str]]]:
    """The report's chart sections: (heading, charts as ``<figure>`` HTML)."""
    c = _Charts(record, summary)
    return [("Logged scalars (session.log)", c.scalars()), ("Steps", c.steps()), ("Device and host", c.system())]
