"""What a run record says in numbers: set-up, duration, throughput, time split, peaks, stragglers."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpukit.report._read import RankRecord, RunInfo, RunRecord

#: events every rank records for one happening of the job (counted once, not once per rank)
JOB_WIDE_EVENTS = ("checkpoint", "preemption", "restart", "precision")

__all__ = ["JOB_WIDE_EVENTS", "FlopFigures", "RankFigures", "RunFigures", "RunSummary", "STRAGGLER_RATIO", "summarize"]

#: A rank whose median step time is this many times the other ranks' median is a straggler.
STRAGGLER_RATIO = 1.15
_PARTS = (("data_s", "data wait"), ("h2d_s", "host-to-device copy"), ("compute_s", "compute"))


@dataclass(frozen=True)
class RankFigures:
    """One rank's figures (``None``: not recorded)."""

    rank: int
    device: str | None
    steps: int
    samples: int
    busy_s: float
    median_step_s: float | None
    samples_per_s: float | None
    time_split_s: dict[str, float]
    peak_torch_allocated_bytes: int | None
    peak_torch_reserved_bytes: int | None
    peak_gpu_mem_used_bytes: int | None
    peak_process_rss_bytes: int | None
    mean_util_pct: float | None
    util_source: str | None
    flops: FlopFigures | None = None


@dataclass(frozen=True)
class FlopFigures:
    """Achieved TFLOP/s and MFU from a rank's ``mfu`` events (one per epoch; see docs/sessions.md, "MFU and achieved TFLOP/s")."""

    steps: int
    seconds: float
    flops_per_step: int
    flops_source: str | None
    achieved_tflops: float
    peak_tflops: float | None
    peak_source: str | None
    dtype: str | None

    @property
    def mfu(self) -> float | None:
        return None if not self.peak_tflops else self.achieved_tflops / self.peak_tflops


def _flop_figures(events: list[dict[str, Any]]) -> FlopFigures | None:
    """All epochs' steps and time summed (the record is untrusted: a line of another shape is passed over)."""
    rows = [e for e in events if e.get("kind") == "mfu" and _numbers(e, "steps", "seconds", "flops_per_step")
            and e["steps"] > 0 and e["seconds"] > 0]
    if not rows:
        return None
    steps = sum(int(e["steps"]) for e in rows)
    seconds = sum(float(e["seconds"]) for e in rows)
    flops = sum(float(e["flops_per_step"]) * e["steps"] for e in rows)
    last = rows[-1]
    peak = last.get("peak_tflops")
    text = lambda key: str(last[key])[:200] if isinstance(last.get(key), str) else None  # noqa: E731
    return FlopFigures(steps=steps, seconds=seconds, flops_per_step=int(last["flops_per_step"]),
                       flops_source=text("flops_source"), achieved_tflops=flops / seconds / 1e12,
                       peak_tflops=float(peak) if _numbers(last, "peak_tflops") and peak > 0 else None,
                       peak_source=text("peak_source"), dtype=text("dtype"))


def _numbers(line: dict[str, Any], *keys: str) -> bool:
    return all(isinstance(line.get(k), (int, float)) and not isinstance(line.get(k), bool)
               and math.isfinite(line[k]) for k in keys)


@dataclass(frozen=True)
class RunFigures:
    """One run's own figures (a record may hold several runs: reruns, restarts, resumes)."""

    info: RunInfo
    steps: int
    samples: int
    samples_per_s: float | None
    span_s: float  # the wall time its steps spanned (what its throughput is measured over)


@dataclass(frozen=True)
class RunSummary:
    """The whole run's figures for the report's summary table."""

    world_size: int
    strategy: str | None
    precision: str | None
    devices: list[str]
    hosts: list[str]
    duration_s: float  # the runs' own durations summed: gaps between runs left out
    span_s: float  # first line to last, gaps included
    finished: bool
    restarts: int
    runs: list[RunFigures]
    samples_per_s: float | None
    time_split_pct: dict[str, float]
    estimated_split: bool
    ranks: list[RankFigures]
    straggler: int | None
    straggler_note: str | None
    events: Counter[str] = field(default_factory=Counter)


def _max(values: list[Any]) -> Any:
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def _weighted_median(pairs: list[tuple[float, int]]) -> float | None:
    """The median of values each standing for ``n`` steps (a line may aggregate many)."""
    if not pairs:
        return None
    pairs.sort()
    half = sum(n for _, n in pairs) / 2
    seen = 0
    for value, n in pairs:
        seen += n
        if seen >= half:
            return value
    return pairs[-1][0]  # pragma: no cover - the loop always returns


def _step_span(steps: list[dict[str, Any]], busy_s: float) -> float:
    """Wall time the steps spanned (first to last step line), or their busy time when one line."""
    times = [s["t"] for s in steps]
    span = (max(times) - min(times)) if len(times) > 1 else 0.0
    return span if span > 0 else busy_s


def _run_figures(record: RunRecord) -> list[RunFigures]:
    out = []
    for k, info in enumerate(record.runs):
        parts = [r.runs[k] for r in record.ranks.values() if len(r.runs) > k]
        steps = [s for p in parts for s in p.steps]
        samples = sum(s["samples"] or 0 for s in steps)
        busy = max((sum((s["step_s"] or 0.0) * s["n"] for s in p.steps) for p in parts), default=0.0)
        span = _step_span(steps, busy)
        per_rank = max((sum(s["n"] for s in p.steps) for p in parts), default=0)
        out.append(RunFigures(info=info, steps=per_rank, samples=samples, span_s=span,
                              samples_per_s=samples / span if span > 0 and samples else None))
    return out


def _rank_figures(record: RankRecord) -> RankFigures:
    steps = record.steps
    n = sum(s["n"] for s in steps)
    busy = sum((s["step_s"] or 0.0) * s["n"] for s in steps)
    samples = sum(s["samples"] or 0 for s in steps)
    split = {key: sum((s[key] or 0.0) * s["n"] for s in steps)
             for key, _ in _PARTS if any(s[key] is not None for s in steps)}  # absent: not measured
    gpu_util = [s["gpu_util_pct"] for s in record.samples if isinstance(s.get("gpu_util_pct"), (int, float))]
    cpu_util = [s["cpu_pct"] for s in record.samples if isinstance(s.get("cpu_pct"), (int, float))]
    util, source = (gpu_util, "GPU") if gpu_util else (cpu_util, "CPU") if cpu_util else ([], None)
    field_max = lambda key: _max([s.get(key) for s in record.samples])  # noqa: E731
    return RankFigures(
        rank=record.rank, device=record.meta.get("device"), steps=n, samples=samples, busy_s=busy,
        median_step_s=_weighted_median([(s["step_s"], s["n"]) for s in steps if s["step_s"] is not None]),
        samples_per_s=samples / busy if busy > 0 and samples else None, time_split_s=split,
        peak_torch_allocated_bytes=field_max("torch_allocated_bytes"),
        peak_torch_reserved_bytes=field_max("torch_reserved_bytes"),
        peak_gpu_mem_used_bytes=field_max("gpu_mem_used_bytes"),
        peak_process_rss_bytes=field_max("process_rss_bytes"),
        mean_util_pct=statistics.fmean(util) if util else None, util_source=source,
        flops=_flop_figures(record.events),
    )


def _straggler(ranks: list[RankFigures]) -> tuple[int | None, str | None]:
    timed = [r for r in ranks if r.median_step_s]
    if len(timed) < 2:
        return None, None
    slowest = max(timed, key=lambda r: r.median_step_s or 0.0)
    others = statistics.median(r.median_step_s or 0.0 for r in timed if r is not slowest)
    if not others or (slowest.median_step_s or 0.0) < STRAGGLER_RATIO * others:
        return None, None
    ratio = (slowest.median_step_s or 0.0) / others
    note = f"rank {slowest.rank} is a straggler: its median step takes {ratio:.2f}x the other ranks'"
    # the part of the step that grew most against the other ranks' median says where to look
    excess = []
    for key, label in _PARTS:
        mine = slowest.time_split_s.get(key, 0.0) / max(1, slowest.steps)
        theirs = statistics.median(r.time_split_s.get(key, 0.0) / max(1, r.steps) for r in timed if r is not slowest)
        excess.append((mine - theirs, label, mine, theirs))
    grown, label, mine, theirs = max(excess)
    if grown > 0:
        note += f" (mostly {label}: {mine * 1000:.3g} ms per step against {theirs * 1000:.3g} ms)"
    return slowest.rank, note + "; the others wait for it at every gradient sync."


def summarize(record: RunRecord) -> RunSummary:
    """Summarize a record (a run still in progress included)."""
    ranks = [_rank_figures(r) for r in record.ranks.values()]
    metas = [r.meta for r in record.ranks.values()]
    first = metas[0] if metas else {}
    busy = sum(r.busy_s for r in ranks)
    split = {label: 100.0 * sum(r.time_split_s.get(key, 0.0) for r in ranks) / busy
             for key, label in _PARTS if busy > 0 and any(r.time_split_s.get(key) for r in ranks)}
    # throughput: samples of all ranks over the wall time each run's steps spanned (gaps left out)
    runs = _run_figures(record)
    samples = sum(r.samples for r in runs)
    span = sum(r.span_s for r in runs if r.samples)
    straggler, note = _straggler(ranks)
    events: Counter[str] = Counter()
    for r in record.ranks.values():
        for kind, count in r.event_kinds.items():
            # a save, a resume, a stop or a restart happens on every rank: one event of the job, not one per rank
            events[kind] = max(events[kind], count) if kind in JOB_WIDE_EVENTS else events[kind] + count
    return RunSummary(
        world_size=int(first.get("world_size") or len(record.ranks)),
        strategy=first.get("strategy"), precision=first.get("precision"),
        devices=[f"rank {rank}: {r.meta.get('device') or '?'}"
                 + (f" ({r.meta['gpu_name']}, GPU {r.meta.get('gpu_index')})" if r.meta.get("gpu_name") else "")
                 for rank, r in record.ranks.items()],
        hosts=sorted({m.get("host") or "?" for m in metas}),
        duration_s=record.duration_s, span_s=record.span_s, finished=record.finished,
        restarts=max((m.get("restart_count") or 0 for m in metas), default=0), runs=runs,
        samples_per_s=samples / span if span > 0 and samples else None,
        time_split_pct=split,
        estimated_split=any(not s["exact"] for r in record.ranks.values() for s in r.steps),
        ranks=ranks, straggler=straggler, straggler_note=note, events=events,
    )
