"""The run's directory between two worker groups: a restarted group starts without the old one's stops and
heartbeats."""

from __future__ import annotations

from pathlib import Path

from gpukit.worker import (
    checkpoints_seen,
    clear_markers,
    note_checkpoint,
    read_heartbeats,
    read_markers,
    stack_path,
    stop_markers,
)
from gpukit.worker._run_dir import FINISHED, heartbeat_path, write_marker


def test_a_new_group_clears_the_stops_of_the_group_it_replaces(tmp_path: Path) -> None:
    # the group the agent stopped to re-form (a node back): ranks 1 and 2 saved and finished their stop
    write_marker(tmp_path, 1, "SIGTERM", FINISHED)
    write_marker(tmp_path, 2, "SIGTERM", FINISHED)
    note_checkpoint(40, 1, tmp_path)
    heartbeat_path(tmp_path, 2).write_text('{"rank": 2, "pid": 4242, "time": 1.0}')
    stack_path(tmp_path, 2).write_text("Thread 0x1 (most recent call first): ...")
    assert stop_markers(tmp_path) == {1: "SIGTERM", 2: "SIGTERM"}  # left, they would read as a preemption
    assert set(read_heartbeats(tmp_path)) == {2}  # left, the stall monitor would suspect a dead rank
    saved = checkpoints_seen(tmp_path)
    clear_markers(tmp_path)
    assert read_markers(tmp_path) == {} and stop_markers(tmp_path) == {}
    assert read_heartbeats(tmp_path) == {} and not stack_path(tmp_path, 2).exists()
    assert checkpoints_seen(tmp_path) == saved  # what the workers saved stays: the launcher still counts it
    clear_markers(tmp_path)  # nothing left to clear: no error
