"""The record reader's bounds, checked in-process: lines, bytes, sampling, names, events, rank files.

(The hostile-input corpus in tests/hostile/corpus_records.py runs the real CLI on the worst
cases; these tests pin the exact behaviour of each bound.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpukit.report import read_record, render_report, summarize
from gpukit.report._files import LineReader, list_rank_files, open_regular
from gpukit.report._rankfile import MAX_EVENTS_PER_RANK

T0 = 1_800_000_000.0
META = {"type": "meta", "t": T0, "format": "gpukit-record", "version": 1, "rank": 0, "world_size": 1}


def _lines(path: Path, data: bytes, **kwargs: int) -> tuple[list[bytes], LineReader]:
    path.write_bytes(data)
    fd, why = open_regular(path)
    assert why is None and fd is not None
    reader = LineReader(fd, **{"max_bytes": 1 << 30, **kwargs})
    return list(reader), reader


def test_line_reader_cuts_lines_across_chunks_and_skips_oversize_ones(tmp_path: Path) -> None:
    long_line = b"x" * (3 << 20)  # spans several 1 MiB chunks
    lines, reader = _lines(tmp_path / "f", b"a\n" + long_line + b"\nb\n\n" + b"y" * 70_000 + b"\nc" + b"z" * (2 << 20)
                           + b"\nlast", max_line_bytes=65_536)
    assert lines == [b"a", b"b", b"last"] and reader.oversize == 3 and not reader.truncated
    lines, reader = _lines(tmp_path / "g", b"0123456789\n" * 10, max_bytes=35)
    assert lines == [b"0123456789"] * 3 + [b"01"] and reader.truncated and reader.read_bytes == 35


def test_only_regular_files_are_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "dir").mkdir()
    reasons = {name: open_regular(tmp_path / name)[1] for name in ("fifo", "zero", "loop", "dangling", "dir")}
    assert reasons == {"fifo": "not a regular file (a FIFO)", "zero": "not a regular file (a character device)",
                       "loop": "a symlink loop", "dangling": "a dangling symlink",
                       "dir": "not a regular file (a directory)"}


def test_rank_files_are_bounded_to_the_lowest_ranks(tmp_path: Path) -> None:
    for rank in (10, 3, 7, 1, 99, 2):
        (tmp_path / f"rank{rank}.jsonl").write_text("")
    (tmp_path / "rank1234567890.jsonl").write_text("")  # too many digits: not a rank file
    listing = list_rank_files(tmp_path, limit=3)
    assert [rank for rank, _ in listing.files] == [1, 2, 3] and listing.found == 6


def test_a_huge_step_record_is_sampled_with_its_totals_scaled(tmp_path: Path) -> None:
    steps = 150_000
    template = '{"type":"step","t":%.3f,"step":%d,"n":1,"samples":32,"step_s":0.01,"exact":true}\n'
    with open(tmp_path / "rank0.jsonl", "w") as handle:
        handle.write(json.dumps(META) + "\n")
        handle.write("".join(template % (T0 + 0.01 * (i + 1), i) for i in range(steps)))
    record = read_record(tmp_path)
    kept = len(record.ranks[0].steps)
    assert 40_000 <= kept < 120_000 and record.ranks[0].unread_lines == steps - kept
    assert any("150,000 step lines" in note and "estimates" in note for note in record.notes)
    summary = summarize(record)
    assert summary.ranks[0].steps == pytest.approx(steps, rel=0.01)
    assert summary.samples_per_s == pytest.approx(3200, rel=0.02)  # 32 samples every 10 ms
    assert "150,000 step lines" in render_report(record)


def test_names_are_cut_with_an_ellipsis_and_counts_are_capped(tmp_path: Path) -> None:
    lines = [META]
    for i in range(60):
        lines.append({"type": "step", "t": T0 + i + 1, "step": i, "samples": 1, "step_s": 0.1,
                      "scalars": {f"metric_{i:02d}_" + "n" * 500: 1.0, "loss": 1.0}})
    for i in range(MAX_EVENTS_PER_RANK + 40):
        lines.append({"type": "event", "t": T0 + 1, "kind": "k" * 1000, "step": 1, "detail": "d" * 10_000})
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = read_record(tmp_path)
    names = record.ranks[0].scalar_names
    assert len(names) == 48 and "loss" in names and all(len(n) <= 80 for n in names)
    assert all(n.endswith("…") for n in names if n != "loss")
    assert sum(record.ranks[0].event_kinds.values()) == MAX_EVENTS_PER_RANK + 40
    assert len(record.ranks[0].events) == MAX_EVENTS_PER_RANK
    text = render_report(record)
    assert "d" * 1000 not in text and "k" * 100 not in text and "…" in text
    assert "and 40 more" in text and "scalars beyond the first 48 names" in text
    assert len(text) < 2_000_000


@pytest.mark.slow  # writes a 120 MB record (~5 s) and reports it in a fresh process
def test_a_million_step_lines_report_in_seconds_of_cpu(tmp_path: Path) -> None:
    import subprocess
    import sys

    template = ('{"type":"step","t":%.3f,"step":%d,"n":1,"epoch":0,"samples":32,"step_s":0.01,'
                '"data_s":0.002,"compute_s":0.008,"max_step_s":0.01,"exact":true,"scalars":{"loss":%.5f}}\n')
    with open(tmp_path / "rank0.jsonl", "w") as handle:
        handle.write(json.dumps(META) + "\n")
        for block in range(0, 1_000_000, 10_000):
            handle.write("".join(template % (T0 + 0.01 * (i + 1), i, 1.0 / (i + 1)) for i in range(block, block + 10_000)))
    # measured in a fresh wrapper process: its only child is the report, so getrusage is the report's own
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True); "
               "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
               "print(p.returncode, u.ru_utime + u.ru_stime, u.ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "gpukit", "report", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    code, cpu_s, rss_kib = proc.stdout.split()
    assert code == "0", proc.stderr
    # CPU time, not wall time: the machine may be busy. The old reader took 14 s of CPU and 1.7 GB.
    assert float(cpu_s) < 6.0, f"report took {float(cpu_s):.1f} s of CPU"
    assert int(rss_kib) < 300 * 1024, f"peak RSS {int(rss_kib) / 1024:.0f} MiB"
    report = (tmp_path / "report.html").read_text()
    assert "1,000,000 step lines" in report and len(report) < 1_000_000
