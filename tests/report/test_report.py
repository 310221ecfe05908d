"""Reading a record, its summary (straggler included), the HTML report, the CLI, the TB replay."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.errors import ConfigurationError
from gpukit.monitor import tensorboard_available
from gpukit.report import read_record, render_report, summarize, write_report

sys.path.insert(0, str(Path(__file__).parent))
from report_helpers import write_record  # noqa: E402


def _gpukit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpukit", *args], capture_output=True, text=True, timeout=120)


def test_summary_names_the_straggler_and_where_the_time_went(tmp_path: Path) -> None:
    summary = summarize(read_record(write_record(tmp_path)))
    assert summary.world_size == 3 and summary.finished and summary.precision == "bf16-mixed"
    assert summary.straggler == 2 and summary.devices[1] == "rank 1: cuda:1 (NVIDIA H100, GPU 1)"
    assert "rank 2 is a straggler" in summary.straggler_note and "data wait" in summary.straggler_note
    assert summary.time_split_pct["compute"] == pytest.approx(100 * 0.030 / (0.013 * 2 + 0.015), rel=1e-6)
    figures = summary.ranks[0]
    assert figures.steps == 60 and figures.samples_per_s == pytest.approx(32 / 0.013)
    assert figures.peak_torch_reserved_bytes == 2 * 2**30 and figures.util_source == "GPU"
    assert summary.events["checkpoint"] == 1  # one save, recorded by each of the 3 ranks


def test_no_straggler_when_ranks_are_even(tmp_path: Path) -> None:
    summary = summarize(read_record(write_record(tmp_path, straggler=None)))
    assert summary.straggler is None and summary.straggler_note is None


def test_html_report_is_self_contained_with_plots_and_the_straggler_highlighted(tmp_path: Path) -> None:
    write_record(tmp_path / "run")
    path = write_report(tmp_path / "run")
    assert path == tmp_path / "run" / "report.html"
    text = path.read_text()
    assert not re.search(r"(src|href)=\"https?:", text) and "<script" not in text  # opens offline
    paths = re.findall(r'<path class="series[^"]*" d="([^"]+)"', text)
    assert len(paths) >= 3 * 4 and all(d.count(",") >= 2 for d in paths)
    assert '<tr class="straggler"><td>2</td>' in text and 'id="straggler"' in text
    for title in ("loss", "Step time per rank", "Throughput per rank", "Where step time went, rank 2",
                  "GPU utilization", "Memory, rank 0"):
        assert title in text
    assert "NVML used" in text and "torch allocated" in text and "checkpoint" in text


def test_report_of_a_run_in_progress_with_a_torn_last_line(tmp_path: Path) -> None:
    directory = write_record(tmp_path, ranks=1, finished=False, gpu=False)
    with open(directory / "rank0.jsonl", "a") as handle:
        handle.write('{"type":"step","t":1800000010.0,"st')
    record = read_record(directory)
    assert not record.finished and record.ranks[0].skipped_lines == 1 and len(record.ranks[0].steps) == 60
    text = render_report(record)
    assert "in progress" in text and "1 incomplete or unreadable line(s) skipped" in text
    assert "CPU utilization" in text and "process resident" in text  # no GPU: the CPU figures


def test_unreadable_records_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not a directory"):
        read_record(tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="no rank<N>.jsonl"):
        read_record(tmp_path)
    (tmp_path / "rank0.jsonl").write_text(json.dumps({"type": "meta", "t": 1, "format": "gpukit-record",
                                                      "version": 99}) + "\n")
    with pytest.raises(ConfigurationError, match="newer gpukit"):
        read_record(tmp_path)


def test_non_finite_values_are_gaps_not_broken_paths() -> None:
    from gpukit.report._svg import Series, chart

    svg = chart([Series("loss", [0, 1, 2, 3], [1.0, float("nan"), float("inf"), 0.5], "#000")],
                title="loss", x_label="step")
    d = re.search(r'class="series" d="([^"]+)"', svg).group(1)
    assert "nan" not in svg.lower() and "inf" not in d and d.count("M") == 2


def test_cli_writes_the_report_and_replays_into_tensorboard(tmp_path: Path) -> None:
    write_record(tmp_path / "run")
    out = tmp_path / "elsewhere" / "r.html"
    tb_args = ["--tensorboard", str(tmp_path / "tb")] if tensorboard_available() else []
    result = _gpukit("report", str(tmp_path / "run"), "--out", str(out), *tb_args)
    assert result.returncode == 0, result.stderr
    assert f"report: {out}" in result.stdout and out.stat().st_size > 10_000
    if not tb_args:
        pytest.skip("the tensorboard package is not installed: replay not checked")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "rank2"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert len(loss) == 60 and loss[0].value == pytest.approx(2.0) and loss[-1].step == 59
    assert events.Scalars("time/data_s")[0].value == pytest.approx(0.004)
    assert [round(e.value) for e in events.Scalars("system/gpu_util_pct")] == [62] * 6


def test_cli_bad_directory_is_one_line(tmp_path: Path) -> None:
    result = _gpukit("report", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a directory" in result.stderr
    assert "Traceback" not in result.stderr
