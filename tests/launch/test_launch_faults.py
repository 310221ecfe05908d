"""Faults a run meets for real, through `gpukit run --cpu --nproc 2`: the summary must blame the
right rank and the exit code must say what happened.

- a worker SIGKILLed (the out-of-memory killer's way): 137, that rank named, whatever its peers
  exited with after it;
- a rank that stops calling collectives (a hang): named with its stack while the others wait,
  then blamed in the summary when the collective timeout (--timeout) ends the run: 124;
- `if session.is_main: gpukit.save(...)`: a clear error instead of a hang;
- the launcher SIGKILLed: nothing its workers started survives (subprocesses, loader workers).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from launch_helpers import assert_none_survive

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.slow
def test_sigkilled_worker_is_blamed_with_exit_137(start_run) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "5", str(SCRIPTS / "session_stop.py"), "{out}")
    run.files("pid-0", "pid-1")
    os.kill(int((run.out / "pid-1").read_text()), signal.SIGKILL)
    assert run.wait(60) == 128 + signal.SIGKILL, run.output()
    summary = [line for line in run.output().splitlines() if "failed:" in line]
    assert summary and summary[0].startswith("gpukit: rank 1 "), run.output()
    assert "killed by SIGKILL (possibly the out-of-memory killer" in summary[0]
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_stalled_rank_is_named_with_its_stack_and_blamed(start_run) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "2", "--timeout", "6", str(SCRIPTS / "stall.py"), "{out}")
    assert run.wait(90) == 124, run.output()
    output = run.output()
    assert "rank 1 stalled at " in output and "stall.py" in output  # named, where, while it hangs
    assert "rank(s) 0 have waited" in output
    assert "most recent call first" in output  # the stack faulthandler dumped
    summary = [line for line in output.splitlines() if "failed:" in line]
    assert summary and summary[0].startswith("gpukit: rank 1 "), output  # not the waiting rank 0
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_collective_save_on_rank_zero_only_fails_clearly(start_run) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "2", "--timeout", "4", str(SCRIPTS / "save_rank0.py"), "{out}")
    assert run.wait(90) == 1, run.output()
    assert "Call it on every rank" in run.output() and "only 1 of 2 ranks called it" in run.output()
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_process_behind(start_run) -> None:
    run = start_run("--cpu", "--nproc", "2", str(SCRIPTS / "spawner.py"), "{out}")
    run.files("ready-0", "ready-1")
    run.proc.send_signal(signal.SIGKILL)
    run.wait(10)
    assert_none_survive(run.marker, timeout_s=20)  # workers, their subprocesses, loader workers
