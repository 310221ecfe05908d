"""`session.should_stop`: a SIGTERM reaching any rank stops every rank at the same step."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from launch_helpers import assert_none_survive

from gpukit.launch import PREEMPTED_EXIT_CODE

SCRIPT = str(Path(__file__).parent / "scripts" / "session_stop.py")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["one-worker", "launcher"])
def test_all_ranks_stop_at_the_same_step(start_run, target: str) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "20", SCRIPT, "{out}")
    run.files("pid-0", "pid-1")
    if target == "one-worker":
        # only rank 1 is warned (SLURM signals each node's step separately; one may be late or dropped)
        os.kill(int((run.out / "pid-1").read_text()), signal.SIGUSR2)
        sent = "SIGUSR2"
    else:
        run.proc.send_signal(signal.SIGTERM)  # a scheduler preempting the whole job
        sent = "SIGTERM"
    # either way the ranks agreed to stop: preempted, requeue
    assert run.wait(60) == PREEMPTED_EXIT_CODE, run.output()
    steps = [int((run.out / f"stopped-{rank}").read_text()) for rank in (0, 1)]
    assert steps[0] == steps[1] >= 1
    # every rank knows what the stop was, its own signal or not (rank 0 read "SIGTERM": under srun python a
    # rank stopped by the agreement alone did not end 75, and rank 0 did not requeue)
    assert [(run.out / f"agreed-{rank}").read_text() for rank in (0, 1)] == [sent, sent]
    assert_none_survive(run.marker)


def test_should_stop_in_one_process_follows_the_local_flag() -> None:
    import gpukit
    from gpukit.launch import clear_stop_request, request_stop

    session = gpukit.Session(accelerator="cpu", verbose=False)
    clear_stop_request()
    try:
        assert session.should_stop is False
        request_stop()
        assert session.should_stop is True
    finally:
        clear_stop_request()
