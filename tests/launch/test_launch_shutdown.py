"""Zero processes of a run survive: SIGINT, SIGTERM, SIGKILL of the launcher, a crashing
worker, a worker hanging in a collective. Each test is one real `gpukit run`."""

from __future__ import annotations

import signal
import time

import pytest

from gpukit.launch import PREEMPTED_EXIT_CODE

from launch_helpers import BEHAVE, assert_none_survive

pytestmark = pytest.mark.slow

GRACE = "2"


def test_sigint_while_a_worker_hangs_in_a_collective_kills_everything_after_grace(start_run):
    # Both workers ignore SIGTERM (preemption handler) and rank 0 is stuck in all_reduce:
    # only the SIGKILL after --grace can stop them.
    run = start_run("--cpu", "--nproc", "2", "--grace", GRACE, str(BEHAVE), "hang", "{out}")
    run.files("ready-0", "ready-1")
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 128 + signal.SIGINT, run.output()
    elapsed = time.monotonic() - sent
    assert float(GRACE) <= elapsed < float(GRACE) + 10, elapsed
    assert "SIGINT" in run.output()
    assert_none_survive(run.marker)


def test_ctrl_c_interrupts_workers_that_stop_cleanly_and_exits_130(start_run):
    # SIGINT is the user's interrupt: the workers are told so (not "SIGTERM received") and the run
    # exits 130 like any interrupted program -- 75 would ask a scheduler to requeue it
    run = start_run("--cpu", "--nproc", "2", "--grace", "20", str(BEHAVE), "preempt", "{out}")
    run.files("ready-0", "ready-1")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == 128 + signal.SIGINT, run.output()
    assert (run.out / "stopped-0").exists() and (run.out / "stopped-1").exists()  # they saved and left
    output = run.output()
    assert "rank 0: interrupted (SIGINT)" in output and "rank 1: interrupted (SIGINT)" in output
    assert "SIGTERM received" not in output and "preempted" not in output
    assert "run interrupted (SIGINT, Ctrl-C): every worker stopped cleanly (exit code 130)" in output
    assert_none_survive(run.marker)


def test_sigterm_preempts_workers_that_stop_cleanly(start_run):
    run = start_run("--cpu", "--nproc", "2", "--grace", "20", str(BEHAVE), "preempt", "{out}")
    run.files("ready-0", "ready-1")
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == PREEMPTED_EXIT_CODE, run.output()
    assert time.monotonic() - sent < 15  # well inside the grace: they stopped by themselves
    assert (run.out / "stopped-0").exists() and (run.out / "stopped-1").exists()
    assert "preempted" in run.output()
    assert_none_survive(run.marker)


def test_sigkill_of_the_launcher_takes_the_workers_down(start_run):
    run = start_run("--cpu", "--nproc", "2", str(BEHAVE), "sleep", "{out}")
    run.files("ready-0", "ready-1")
    run.proc.send_signal(signal.SIGKILL)
    run.wait()
    assert_none_survive(run.marker, timeout_s=10)


def test_crashing_worker_stops_the_others_names_the_rank_and_counts_restarts(start_run):
    run = start_run("--cpu", "--nproc", "2", "--grace", GRACE, "--max-restarts", "1",
                    str(BEHAVE), "crash", "{out}")
    code = run.wait(timeout_s=90)
    out = run.output()
    assert code == 1, out
    attempts = sorted(p.name for p in run.out.glob("attempt-*-rank-1"))
    assert attempts == ["attempt-0-rank-1", "attempt-1-rank-1"]  # TORCHELASTIC_RESTART_COUNT 0, 1
    summary = out[out.index("gpukit: rank"):]
    assert summary.startswith("gpukit: rank 1 ")
    assert "ZeroDivisionError: division by zero" in summary
    assert "behave.py:" in summary
    assert "after 2 attempts" in summary
    assert_none_survive(run.marker)
