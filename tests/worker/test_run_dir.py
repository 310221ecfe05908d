"""The run's directory between two worker groups: a restarted group starts without the old one's stops."""

from __future__ import annotations

from pathlib import Path

from gpukit.worker import checkpoints_seen, clear_markers, note_checkpoint, read_markers, stop_markers
from gpukit.worker._run_dir import FINISHED, write_marker


def test_a_new_group_clears_the_stops_of_the_group_it_replaces(tmp_path: Path) -> None:
    # the group the agent stopped to re-form (a node back): ranks 1 and 2 saved and finished their stop
    write_marker(tmp_path, 1, "SIGTERM", FINISHED)
    write_marker(tmp_path, 2, "SIGTERM", FINISHED)
    note_checkpoint(40, 1, tmp_path)
    assert stop_markers(tmp_path) == {1: "SIGTERM", 2: "SIGTERM"}  # left, they would read as a preemption
    saved = checkpoints_seen(tmp_path)
    clear_markers(tmp_path)
    assert read_markers(tmp_path) == {} and stop_markers(tmp_path) == {}
    assert checkpoints_seen(tmp_path) == saved  # what the workers saved stays: the launcher still counts it
    clear_markers(tmp_path)  # nothing left to clear: no error
