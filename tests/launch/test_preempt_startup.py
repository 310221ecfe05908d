"""Stops at the hard moments (issue 17): while `gpukit run` itself starts, while its workers start
(no Session yet), and after the workers saved but tear down for longer than --grace. Every one
is a clean stop: exit 75."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launch_helpers import assert_none_survive, catches, poll

from gpukit._util import startup_signals
from gpukit.launch import PREEMPTED_EXIT_CODE

SCRIPTS = Path(__file__).parent / "scripts"


def test_warning_signal_is_held_while_starting() -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        assert startup_signals.hold_warning_signals()
        os.kill(os.getpid(), signal.SIGUSR2)  # its default action would end this process
        assert startup_signals.received() == signal.SIGUSR2
    finally:
        startup_signals.forget()
        signal.signal(signal.SIGUSR2, previous)


def test_a_second_stop_signal_during_the_first_is_one_stop(tmp_path: Path) -> None:
    # SLURM's SIGUSR2, then the launcher's SIGTERM while the worker is still handling the first:
    # Python runs the second handler inside the first; it must not report (and mark) a second stop
    script = textwrap.dedent("""
        import os, signal
        from gpukit.worker import _stop as _preemption
        real = _preemption.write_marker
        def marker_then_second_signal(*args):
            real(*args)
            os.kill(os.getpid(), signal.SIGTERM)  # lands now, inside this handler
            for _ in range(1000):
                pass
        _preemption.write_marker = marker_then_second_signal
        _preemption.install_startup_stop([signal.SIGUSR2, signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGUSR2)
        while True:
            pass
    """)
    env = {**os.environ, "RANK": "0", "GPUKIT_RUN_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("received before rank 0's Session started") == 1, done.stderr
    assert "SIGUSR2 received" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGTERM])
def test_stop_signal_to_gpukit_run_while_it_imports(start_run, signum: signal.Signals) -> None:
    run = start_run("--cpu", "--nproc", "2", str(SCRIPTS / "slow_start.py"), "{out}")
    # the entry point's handler is in place: the signal now lands while click/torch import
    poll(lambda: catches(run.proc.pid, signum) or run.proc.poll() is not None, 30, "the entry handler")
    run.proc.send_signal(signum)
    assert run.wait(90) == PREEMPTED_EXIT_CODE, run.output()
    assert f"{signum.name} received" in run.output() and "Traceback" not in run.output()
    assert_none_survive(run.marker)


def _sigterm_once_started(start_run, args: list[str], files: tuple[str, ...], wait_s: float = 60):  # noqa: ANN001, ANN202
    """A 2-process `gpukit run --cpu ARGS` sent SIGTERM once its workers wrote ``files``;
    returns ``(run, output)`` after checking that it exited as preempted within ``wait_s``."""
    run = start_run("--cpu", "--nproc", "2", *args)
    run.files(*files)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(wait_s) == PREEMPTED_EXIT_CODE, run.output()
    return run, run.output()


@pytest.mark.slow
def test_workers_stopped_before_their_session_exits_at_once(start_run) -> None:
    run, output = _sigterm_once_started(start_run, ["--grace", "60", str(SCRIPTS / "slow_start.py"), "{out}"],
                                        ("starting-0", "starting-1"), wait_s=50)  # well before the 60 s grace
    assert output.count("Session started: nothing to save") == 2, output
    assert "every worker stopped cleanly" in output
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_saved_workers_that_tear_down_past_grace_are_a_clean_stop(start_run) -> None:
    run, output = _sigterm_once_started(start_run, ["--grace", "3", str(SCRIPTS / "slow_teardown.py"), "{out}", "120"],
                                        ("pid-0", "pid-1"))
    assert "every worker finished its stop (2 still tearing down after --grace 3 s were killed then)" in output
    assert [(run.out / f"stopped-{r}").exists() for r in (0, 1)] == [True, True]
    assert len(list((run.out / "ckpt").glob("step_*"))) == 1
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_ranks_stopped_at_different_points_of_their_start_are_a_clean_stop(start_run) -> None:
    run, output = _sigterm_once_started(start_run, ["--grace", "3", str(SCRIPTS / "half_started.py"), "{out}"],
                                        ("starting-0", "starting-1"))
    assert "rank 1's Session started: nothing to save" in output
    assert "a worker had not started its Session yet, nothing was trained to save" in output
    assert_none_survive(run.marker)


@pytest.mark.slow
def test_usr2_while_waiting_for_gpus_ends_the_wait(start_run, tmp_path: Path) -> None:
    spec = tmp_path / "busy.json"  # a fake box whose one GPU never has 30 GiB free
    spec.write_text(json.dumps({"driver_version": "535.104.05", "gpus": [
        {"name": "NVIDIA A100", "uuid": "GPU-1111aaaa-0000-0000-0000-000000000001", "pci_bus_id": "00000000:01:00.0",
         "memory_total_mib": 40960, "memory_used_mib": 30000}]}))
    (tmp_path / "claims").mkdir()
    env = {"GPUKIT_FAKE_GPUS": str(spec), "GPUKIT_CLAIM_DIR": str(tmp_path / "claims")}
    run = start_run("--gpus", "1", "--min-free", "30GiB", "--wait", str(SCRIPTS / "slow_start.py"), "{out}", env=env)
    poll(lambda: "wait" in run.output().lower() or run.proc.poll() is not None, 60, "the wait for GPUs")
    assert run.proc.poll() is None, run.output()
    run.proc.send_signal(signal.SIGUSR2)
    assert run.wait(30) == PREEMPTED_EXIT_CODE, run.output()
    assert "no worker had started yet, nothing to save" in run.output(), run.output()
    assert_none_survive(run.marker)
