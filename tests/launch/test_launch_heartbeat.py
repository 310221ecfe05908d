"""The stall monitor's rule, on heartbeat files written by hand (the real thing: test_launch_faults)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpukit.launch._stall import StallMonitor, stall_threshold_s


def _beat(run_dir: Path, rank: int, now: float, waiting_since: float | None, where: str = "") -> None:
    record = {"rank": rank, "pid": os.getpid() + 10**6, "time": now, "waiting_since": waiting_since, "where": where}
    (run_dir / f"hb-rank{rank}.json").write_text(json.dumps(record))


def test_the_rank_not_in_the_collective_is_named_once(tmp_path: Path) -> None:
    lines: list[str] = []
    monitor = StallMonitor(tmp_path, stall_s=5, echo=lines.append)
    _beat(tmp_path, 0, 100.0, waiting_since=90.0)
    _beat(tmp_path, 1, 100.0, waiting_since=None, where="train.py:7 in <module>")
    _beat(tmp_path, 2, 100.0, waiting_since=98.0)  # waiting, but not long yet
    [stall] = monitor.check(now=100.0)
    assert stall.rank == 1 and stall.waiting_ranks == (0,) and stall.where == "train.py:7 in <module>"
    assert lines and lines[0].startswith("gpukit: rank 1 stalled at train.py:7 in <module>")
    assert monitor.check(now=101.0) == []  # reported once
    _beat(tmp_path, 1, 102.0, waiting_since=101.5)  # it joined the collective after all
    monitor.check(now=102.0)
    assert monitor.stalls == {}


def test_no_blame_while_nobody_has_waited_long(tmp_path: Path) -> None:
    monitor = StallMonitor(tmp_path, stall_s=5, echo=lambda line: None)
    _beat(tmp_path, 0, 100.0, waiting_since=97.0)
    _beat(tmp_path, 1, 100.0, waiting_since=None)
    assert monitor.check(now=100.0) == []
    assert stall_threshold_s(1800) == 60 and stall_threshold_s(6) == 3
