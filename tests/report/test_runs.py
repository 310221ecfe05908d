"""A record holds runs: real Sessions recording three times into one directory (the third resumed).

Each run gets its own row, duration and throughput; the summary's throughput leaves the gaps
between runs out; every plot draws each run as its own segment, after the runs before it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import gpukit
from gpukit.report import read_record, render_report, summarize

STEPS = 16


def _train(record: Path, checkpoints: Path, mode: str) -> int | None:
    """One run (a real Session recording to ``record``): ``save`` a checkpoint at step 8, or ``resume``."""
    session = gpukit.Session(devices="cpu", record=record, verbose=False)
    model = torch.nn.Linear(4, 2)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = TensorDataset(torch.randn(STEPS * 8, 4), torch.randint(0, 2, (STEPS * 8,)))
    loader = session.setup_dataloader(data, batch_size=8)
    resumed = session.resume(checkpoints, model=model, optimizer=optimizer) if mode == "resume" else None
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        session.backward(loss)
        session.step(optimizer)
        session.log(loss=loss)
        if mode == "save" and i == 7:
            session.save_checkpoint(checkpoints, 8, model=model, optimizer=optimizer)
    session.close()
    return resumed


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    assert _train(root / "rec", root / "ckpt", "save") is None
    time.sleep(1.0)  # the user comes back later: a gap between runs (what the old report counted as run time)
    assert _train(root / "rec", root / "ckpt", "fresh") is None
    assert _train(root / "rec", root / "ckpt", "resume") == 8
    return root / "rec"


def test_each_run_has_its_start_duration_throughput_and_resume_mark(three_runs: Path) -> None:
    record = read_record(three_runs)
    assert [run.index for run in record.runs] == [1, 2, 3]
    assert [run.resumed_step for run in record.runs] == [None, None, 8]
    assert [run.label() for run in record.runs][2] == "run 3 (resumed from step 8)"
    assert all(run.finished for run in record.runs) and record.finished
    assert record.runs[0].end_t < record.runs[1].start_t < record.runs[1].end_t < record.runs[2].start_t
    summary = summarize(record)
    assert [f.steps for f in summary.runs] == [STEPS] * 3
    assert all(f.samples == STEPS * 8 and f.samples_per_s and f.span_s < f.info.duration_s for f in summary.runs)
    # the throughput is measured over the time the runs ran, not over the gaps between them
    total = sum(f.samples for f in summary.runs)
    assert summary.samples_per_s == pytest.approx(total / sum(f.span_s for f in summary.runs))
    gap_s = record.runs[1].start_t - record.runs[0].end_t
    assert gap_s >= 1.0 and summary.duration_s <= record.span_s - gap_s
    # what the old report showed (over the whole span, gap included) is lower by at least the gap's share,
    # whatever the machine's load makes the runs last
    assert summary.samples_per_s >= total / (record.span_s - gap_s) > total / record.span_s


def test_plots_draw_each_run_as_a_segment_after_the_one_before(three_runs: Path) -> None:
    record = read_record(three_runs)
    offsets = [run.step_offset for run in record.runs]
    assert offsets == [0, STEPS, 2 * STEPS]  # every process counts from step 0: drawn one after another
    text = render_report(record)
    assert text.count('class="run-start"') >= 2 * 5 and "run 3 (resumed)" in text
    assert '<table id="runs">' in text and "run 3 (resumed from step 8)" in text
    step_chart = text[text.index("<figcaption>loss</figcaption>"):]
    d = re.search(r'<path class="series" d="([^"]+)"', step_chart).group(1)
    segments = [seg for seg in d.split("M") if seg.strip()]
    assert len(segments) == 3  # one per run: the pen is lifted between runs
    xs = [[float(p.split(",")[0]) for p in seg.replace("L", " ").split()] for seg in segments]
    assert all(a == sorted(a) for a in xs)  # no segment goes back
    assert xs[0][-1] < xs[1][0] and xs[1][-1] < xs[2][0]  # each run starts after the one before ends


def test_a_resume_on_another_size_says_the_sizes_and_the_steps_redone(tmp_path: Path) -> None:
    import json

    assert _train(tmp_path / "rec", tmp_path / "ckpt", "save") is None  # saves step 8, trains on to 16
    marker_path = tmp_path / "ckpt" / "step_00000008" / "complete.json"
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "world_size": 2}))  # as if 2 processes had saved it
    with pytest.warns(UserWarning, match="saved by 2 process"):
        assert _train(tmp_path / "rec", tmp_path / "ckpt", "resume") == 8
    run = read_record(tmp_path / "rec").runs[1]
    assert (run.saved_world_size, run.world_size, run.steps_redone) == (2, 1, STEPS - 8)
    assert run.label() == f"run 2 (resumed from step 8; 2 -> 1 processes; {STEPS - 8} step(s) redone)"
