"""The report of a multi-rank run (issue 28, item 11): a save counted once, not once per rank; rank 0's
line drawn on top; the step axis ending where the steps do; charts as wide as the page allows."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gpukit.report import read_record, render_report, summarize
from gpukit.report._svg import _R, _W, Series, chart

sys.path.insert(0, str(Path(__file__).parent))
from report_helpers import T0, write_record  # noqa: E402


def _add_events(directory: Path, rank: int, lines: list[dict]) -> None:
    path = directory / f"rank{rank}.jsonl"
    body = path.read_text().splitlines()
    end = [line for line in body if json.loads(line)["type"] == "end"]
    kept = [line for line in body if json.loads(line)["type"] != "end"]
    path.write_text("\n".join(kept + [json.dumps(line) for line in lines] + end) + "\n")


def test_a_save_on_every_rank_is_one_checkpoint_while_per_rank_events_add_up(tmp_path: Path) -> None:
    directory = write_record(tmp_path, ranks=2, steps=320)  # one checkpoint event on each rank already
    for rank in (0, 1):
        _add_events(directory, rank, [{"type": "event", "t": T0 + 10 + i, "kind": "checkpoint", "step": 31 * i,
                                       "saved_step": 32 * (i + 2)} for i in range(9)])
    _add_events(directory, 1, [{"type": "event", "t": T0 + 30, "kind": "oom_backoff", "step": 40,
                                "from_micro_batch": 8, "to_micro_batch": 4}])
    _add_events(directory, 0, [{"type": "event", "t": T0 + 31, "kind": "oom_backoff", "step": 41,
                                "from_micro_batch": 8, "to_micro_batch": 4}])
    record = read_record(directory)
    summary = summarize(record)
    assert summary.events["checkpoint"] == 10  # 10 saves, each recorded by both ranks
    assert summary.events["oom_backoff"] == 2  # one on each rank: two events
    page = render_report(record)
    assert "checkpoint x10" in page and "checkpoint x20" not in page


def test_the_step_axis_ends_at_the_last_step() -> None:
    xs = list(range(320))
    svg = chart([Series("rank 0", xs, [1.0] * 320, "#000")], title="loss", x_label="step")
    labels = re.findall(r'<text class="tick" x="[\d.]+" y="\d+" text-anchor="middle">([^<]+)</text>', svg)
    assert labels[-1] == "300" and "400" not in labels
    path = re.search(r'<path class="series" d="([^"]+)"', svg).group(1)
    right = max(float(x) for x in re.findall(r"[ML]([\d.]+),", path))
    assert right == _W - _R  # the last step is at the frame's right edge, no empty fifth of the plot


def test_rank_0_is_drawn_last_so_it_shows_where_the_ranks_agree() -> None:
    xs = list(range(10))
    svg = chart([Series("rank 0", xs, [1.0] * 10, "#111"), Series("rank 1", xs, [1.0] * 10, "#222")],
                title="loss", x_label="step")
    drawn = re.findall(r'<path class="series"[^>]*><title>([^<]+)</title>', svg)
    assert drawn == ["rank 1", "rank 0"]
    legend = re.findall(r"</i>([^<]+)</span>", svg)
    assert legend == ["rank 0", "rank 1"]  # the legend keeps rank order


def test_charts_scale_to_the_page_width(tmp_path: Path) -> None:
    page = render_report(read_record(write_record(tmp_path, ranks=2)))
    assert re.search(r"<svg viewBox=\"0 0 \d+ \d+\" role=\"img\"", page)  # no fixed width: the CSS sizes it
    assert "figure.chart svg{display:block;width:100%;height:auto}" in page
    assert "grid-template-columns:repeat(auto-fill,minmax(520px,1fr))" in page  # columns as the page allows
    assert "max-width:1320px" not in page  # the page's width, not a fixed column in its middle


def test_the_precision_fit_chose_at_setup_is_the_runs_once_whatever_the_ranks(tmp_path: Path) -> None:
    """Session(fit=...) chooses the precision at setup, after each rank's header said the one before: every
    rank records a "precision" event, which the summary shows (and counts once, as a save)."""
    directory = write_record(tmp_path, ranks=2, steps=20)
    before = summarize(read_record(directory)).precision
    for rank in (0, 1):
        _add_events(directory, rank, [{"type": "event", "t": T0 + 1, "kind": "precision", "step": None,
                                       "precision": "bf16-true", "was": before, "chosen_by": "fit"}])
    summary = summarize(read_record(directory))
    assert before != "bf16-true" and summary.precision == "bf16-true"
    assert summary.events["precision"] == 1
