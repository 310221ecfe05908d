"""A rank that stopped with the others before its own stop signal came marks a stop, not a finished
training (issue 41's preempted-test flake: SLURM's warning reaches each node's step separately)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit.worker import COMPLETED, clear_stop_request, mark_stop_agreed, read_markers, stop_requested
from gpukit.worker._run_dir import FINISHED
from gpukit.worker._stop import finish_agreed_stop, mark_completed


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("GPUKIT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    clear_stop_request()
    yield tmp_path
    clear_stop_request()


def test_a_rank_stopped_by_the_agreement_alone_marks_a_stop(run_dir: Path) -> None:
    # session.should_stop was true because another rank was warned; this rank's own warning is on its way
    mark_stop_agreed(1)
    assert not stop_requested()
    # the script then ends by itself (exit 0), as after every agreed stop
    assert finish_agreed_stop()  # was False: the rank was marked "completed", and its node's launcher took
    assert read_markers(run_dir)[1].state == FINISHED  # the late warning for one after the training


def test_a_script_that_ended_with_no_stop_is_completed(run_dir: Path) -> None:
    assert not finish_agreed_stop()
    assert mark_completed()
    assert read_markers(run_dir)[1].state == COMPLETED
