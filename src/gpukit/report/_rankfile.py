"""One rank file read into its runs, in bounded time and memory whatever it holds.

Parsing a line costs microseconds, so a file of millions of lines cannot be parsed in full and
still report in seconds. Lines are classed first by their opening bytes (the recorder writes
``{"type":"step",...``): headers are parsed up to :data:`MAX_RUNS`, events up to
:data:`MAX_EVENTS_PER_RANK` (the rest counted), and step and system lines are *sampled* once
their count passes the rank's budget: past ``budget`` lines of a class one line in 4 is parsed,
past ``2 x budget`` one in 16, past ``4 x budget`` one in 64, and so on, so a file of any length
costs at most 1.5 x budget parsed lines (and its 64 KiB-bounded lines read). A sampled step
line stands for the lines passed over since the previous one: its step count and samples are
scaled by the stride, so totals and throughput are estimates of the same size, and the report
says so. A record written by gpukit (about 11,000 step lines per million steps) is read in full.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpukit.report._files import MAX_LINE_BYTES, LineReader
from gpukit.report._lines import parse_line
from gpukit.report._records import RankRecord, RankRun

__all__ = ["MAX_EVENTS_PER_RANK", "MAX_RUNS", "PARSE_BUDGET", "read_rank"]

PARSE_BUDGET = 40_000  # step (and, apart, sys) lines read in full over the record; each rank gets a share
MAX_RUNS = 64  # runs told apart per rank file; later headers continue the last run
MAX_EVENTS_PER_RANK = 500  # read in full; the rest only counted
MAX_SCALAR_NAMES = 48
MAX_EVENT_KINDS = 64
_PREFIX = b'{"type":"'
_UNREAD_EVENTS = "(not read: over the limit)"


class _Sampler:
    """Says which lines of one class to parse: all of the first ``budget``; past ``budget x 2^k``
    lines, one in ``4^(k+1)`` -- so at most ``1.5 x budget`` are parsed however long the file is."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.seen = 0
        self.level = 1
        self.stride = 1
        self.passed = 0

    def take(self) -> int:
        """0: pass this line over; else the stride it stands for."""
        seen = self.seen
        self.seen += 1
        if seen >= self.budget * self.level:
            self.level *= 2
            self.stride = self.level * self.level
        if seen % self.stride:
            self.passed += 1
            return 0
        return self.stride


class _RankReader:
    def __init__(self, rank: int, path: Path, budget: int) -> None:
        self.record = RankRecord(rank=rank, path=path)
        self.samplers = {b"step": _Sampler(budget), b"sys\"": _Sampler(budget), b"": _Sampler(budget)}
        self.extra_headers = 0
        self.events = 0

    def run(self) -> RankRun:
        if not self.record.runs:
            self.record.runs.append(RankRun(meta={}))
        return self.record.runs[-1]

    def feed(self, raw: bytes, source: str) -> None:
        key = raw[9:13] if raw.startswith(_PREFIX) else b""
        weight = 1
        if key == b"meta" and len(self.record.runs) >= MAX_RUNS:
            self.extra_headers += 1
            return
        if key == b"even" and self.events >= MAX_EVENTS_PER_RANK:
            self.record.dropped_events += 1
            self.record.event_kinds[_UNREAD_EVENTS] += 1
            return
        if key not in (b"meta", b"even", b"end\""):
            weight = self.samplers.get(key, self.samplers[b""]).take()
            if not weight:
                return
        line = parse_line(raw, source)
        if line is None:
            self.record.skipped_lines += 1
        elif line["type"] is not None:
            self.add(line, weight)

    def add(self, line: dict[str, Any], weight: int) -> None:
        kind = line["type"]
        if kind == "meta":
            if len(self.record.runs) < MAX_RUNS:
                self.record.runs.append(RankRun(meta=line))
            else:
                self.extra_headers += 1
        run = self.run()
        run.see(line["t"])
        if kind == "step":
            if weight > 1:  # stands for the lines passed over before it
                line["n"] *= weight
                line["samples"] = None if line["samples"] is None else line["samples"] * weight
            self._scalars(line)
            run.steps.append(line)
        elif kind == "sys":
            run.samples.append(line)
        elif kind == "event":
            self._event(run, line)
        elif kind == "end":
            run.ended = True

    def _scalars(self, line: dict[str, Any]) -> None:
        scalars = line.get("scalars")
        if not scalars:
            return
        names = self.record.scalar_names
        for name in list(scalars):
            if name not in names:
                if len(names) >= MAX_SCALAR_NAMES:
                    del scalars[name]
                    self.record.dropped_scalar_names += 1
                    continue
                names.add(name)

    def _event(self, run: RankRun, line: dict[str, Any]) -> None:
        kinds = self.record.event_kinds
        kind = line["kind"] if line["kind"] in kinds or len(kinds) < MAX_EVENT_KINDS else "(other kinds)"
        kinds[kind] += 1
        if line["kind"] == "precision" and isinstance(line.get("precision"), str) and run.meta:
            run.meta["precision"] = line["precision"]  # Session(fit=...) chose it at setup, after the header
        if line["kind"] == "checkpoint" and isinstance(line.get("resumed_step"), int):
            run.resumed_step = line["resumed_step"]
            saved = line.get("saved_world_size")
            run.resumed_from_world = saved if isinstance(saved, int) and not isinstance(saved, bool) else None
        if self.events < MAX_EVENTS_PER_RANK:
            self.events += 1
            run.events.append(line)
        else:
            self.record.dropped_events += 1


def read_rank(rank: int, path: Path, fd: int, max_bytes: int, budget: int) -> tuple[RankRecord, list[str]]:
    """Read the open regular file ``fd`` (closed when done): its record, and notes on what was left out."""
    reader = _RankReader(rank, path, budget)
    lines = LineReader(fd, max_bytes)
    source = str(path)
    for raw in lines:
        reader.feed(raw, source)
    record = reader.record
    record.skipped_lines += lines.oversize
    record.truncated = lines.truncated
    record.unread_lines = sum(s.passed for s in reader.samplers.values())
    name = path.name
    notes = []
    if lines.truncated:
        notes.append(f"{name}: only its first {max_bytes / 2**20:,.0f} MiB were read (the record's "
                     "read limit is shared among its rank files)")
    if lines.oversize:
        notes.append(f"{name}: {lines.oversize:,} line(s) over {MAX_LINE_BYTES // 1024} KiB skipped")
    for key, what in ((b"step", "step"), (b"sys\"", "system sample"), (b"", "other")):
        sampler = reader.samplers[key]
        if sampler.passed:
            notes.append(f"{name}: {sampler.seen:,} {what} lines; past the first {sampler.budget:,} one in "
                         f"4, 16 ... {sampler.stride} was read ({sampler.passed:,} passed over; step counts, "
                         "samples and throughput are estimates scaled by the stride)")
    if reader.extra_headers:
        notes.append(f"{name}: {reader.extra_headers:,} more run header(s) than the {MAX_RUNS} runs told "
                     "apart; their lines are counted in the last run")
    if record.dropped_events:
        notes.append(f"{name}: {record.dropped_events:,} event(s) after the first {MAX_EVENTS_PER_RANK} are "
                     "counted but not listed")
    if record.dropped_scalar_names:
        notes.append(f"{name}: scalars beyond the first {MAX_SCALAR_NAMES} names are left out "
                     f"({record.dropped_scalar_names:,} value(s))")
    return record, notes
