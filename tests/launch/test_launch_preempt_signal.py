"""The scheduler's preemption signal (SLURM --signal, default SIGUSR2): sets the stop flag like
SIGTERM, never escalates, stops `gpukit run` cleanly, and requeues the SLURM job once.
(The real cluster runs it end to end in tests/cluster/test_slurm_cluster.py.)"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import assert_none_survive, gpukit_command

from gpukit.cluster import environment, requeue_job
from gpukit.errors import ConfigurationError
from gpukit.launch import PREEMPTED_EXIT_CODE, install_preemption_handler, stop_requested
from gpukit.worker import max_requeues_from_env, parse_preempt_signal, preempt_signal, requeue_after_preemption
from gpukit.worker import session_stop_signals, stop_signal_name

SCRIPTS = Path(__file__).parent / "scripts"
SESSION_STOP = str(SCRIPTS / "session_stop.py")
SLURM_JOB = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


pytestmark = pytest.mark.usefixtures("clean_stop_flag")


@pytest.mark.parametrize("text", ["USR2", "SIGUSR2", "usr2", " sigusr1 ", "TERM"])
def test_signal_names(text: str) -> None:
    assert parse_preempt_signal(text).name == "SIG" + text.strip().upper().removeprefix("SIG")


def test_unknown_signal_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="USR2, USR1, TERM"):
        parse_preempt_signal("HUP")
    monkeypatch.setenv("GPUKIT_PREEMPT_SIGNAL", "KILL")
    with pytest.raises(ConfigurationError, match="GPUKIT_PREEMPT_SIGNAL"):
        preempt_signal()
    monkeypatch.setenv("GPUKIT_PREEMPT_SIGNAL", "usr1")
    assert preempt_signal() == signal.SIGUSR1
    monkeypatch.delenv("GPUKIT_PREEMPT_SIGNAL")
    assert preempt_signal() == signal.SIGUSR2


def test_warning_then_sigterm_does_not_kill() -> None:
    # SLURM signals every process of the step, then gpukit run sends SIGTERM: still one stop.
    install_preemption_handler((signal.SIGTERM, signal.SIGUSR2))
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_requested() and stop_signal_name() == "SIGUSR2"  # we are alive to check


def test_sessions_catch_the_warning_only_where_a_scheduler_or_launcher_sends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("GPUKIT_LAUNCHER_PID", "TORCHELASTIC_RUN_ID", "GPUKIT_PREEMPT_SIGNAL", *SLURM_JOB):
        monkeypatch.delenv(key, raising=False)
    assert signal.SIGUSR2 not in session_stop_signals()  # plain python: USR2 stays the user's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert signal.SIGUSR2 not in session_stop_signals()  # torchrun outside SLURM: the same
    monkeypatch.setenv("GPUKIT_LAUNCHER_PID", "1")
    assert signal.SIGUSR2 in session_stop_signals()  # gpukit run treats it as preemption
    monkeypatch.delenv("GPUKIT_LAUNCHER_PID")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for key, value in SLURM_JOB.items():
        monkeypatch.setenv(key, value)
    assert signal.SIGUSR2 in session_stop_signals()
    monkeypatch.setenv("GPUKIT_PREEMPT_SIGNAL", "USR1")
    assert signal.SIGUSR1 in session_stop_signals() and signal.SIGUSR2 not in session_stop_signals()


def _fake_scontrol(tmp_path: Path, exit_code: int = 0) -> Path:
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\necho 'slurm_requeue error: Requested "
                      f"operation is presently disabled' >&2\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_requeue_calls_scontrol_and_is_bounded(tmp_path: Path) -> None:
    env = environment(SLURM_JOB)
    done = requeue_job(env, 3, scontrol=str(_fake_scontrol(tmp_path)))
    assert done.requeued and (tmp_path / "calls").read_text() == "requeue 77\n"
    assert "requeue 1 of at most 3" in done.message
    tired = requeue_job(environment({**SLURM_JOB, "SLURM_RESTART_COUNT": "3"}), 3,
                        scontrol=str(_fake_scontrol(tmp_path)))
    assert not tired.requeued and "requeued 3 time(s)" in tired.message and "submit the job again" in tired.message
    assert (tmp_path / "calls").read_text() == "requeue 77\n"  # not called again


def test_requeue_failures_are_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = environment(SLURM_JOB)
    refused = requeue_job(env, 3, scontrol=str(_fake_scontrol(tmp_path, exit_code=1)))
    assert not refused.requeued and "presently disabled" in refused.message and "--requeue" in refused.message
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    missing = requeue_job(env, 3)
    assert not missing.requeued and "scontrol` is not on PATH" in missing.message
    assert not requeue_job(environment({}), 3).requeued  # not a SLURM job


def test_only_the_preemption_signal_on_rank_0_requeues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    _fake_scontrol(tmp_path)
    lines: list[str] = []
    usr2 = signal.SIGUSR2
    assert requeue_after_preemption("SIGTERM", usr2, max_requeues=3, env=environment(SLURM_JOB), echo=lines.append) is None
    rank1 = environment({**SLURM_JOB, "SLURM_PROCID": "1", "SLURM_NODEID": "1"})
    assert requeue_after_preemption("SIGUSR2", usr2, max_requeues=3, env=rank1, echo=lines.append) is None
    done = requeue_after_preemption("SIGUSR2", usr2, max_requeues=3, env=environment(SLURM_JOB), echo=lines.append)
    assert done is not None and done.requeued and lines == [f"gpukit: {done.message}"]


def test_max_requeues_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUKIT_MAX_REQUEUES", raising=False)
    assert max_requeues_from_env() == 10
    monkeypatch.setenv("GPUKIT_MAX_REQUEUES", "0")
    assert max_requeues_from_env() == 0
    monkeypatch.setenv("GPUKIT_MAX_REQUEUES", "-2")
    with pytest.raises(ConfigurationError, match="whole number >= 0"):
        max_requeues_from_env()


@pytest.mark.parametrize(("args", "message"), [
    (("--signal", "HUP"), "USR2, USR1, TERM"),
    (("--max-requeues", "-1"), "--max-requeues"),  # the CLI's range check (cli/_common.py) names it
])
def test_bad_options_are_one_line(args: tuple[str, ...], message: str) -> None:
    import subprocess

    result = subprocess.run([*gpukit_command("run", *args, "--cpu", SESSION_STOP, "x")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigusr2_to_gpukit_run_stops_the_workers_cleanly(start_run) -> None:
    run = start_run("--cpu", "--nproc", "1", "--grace", "20", SESSION_STOP, "{out}")
    run.files("pid-0")
    run.proc.send_signal(signal.SIGUSR2)
    assert run.wait(60) == PREEMPTED_EXIT_CODE, run.output()
    assert "run preempted: SIGUSR2 received" in run.output()
    assert int((run.out / "stopped-0").read_text()) >= 1  # the worker left its loop, not killed
    assert "requeue" not in run.output()  # not a SLURM job: nothing to requeue
    assert_none_survive(run.marker)


def _srun_python_task(tmp_path: Path, body: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    """What a Session does under `srun python train.py`, without torch: arm the exit, catch, then
    ``body`` (the script's loop), then exit 0 as a script that saved and left does."""
    _fake_scontrol(tmp_path)
    code = (
        "import atexit, os, signal, sys\n"
        "from gpukit.worker import install_preemption_handler, mark_stop_agreed, requeue_at_exit, session_stop_signals\n"
        # registered first, so it runs after gpukit's hook: what Python's finalization keeps (it sets a
        # Python handler back to the default action, death by SIGUSR2; an ignored signal stays ignored)
        "atexit.register(lambda: print('late warning:', 'ignored' if signal.getsignal(signal.SIGUSR2) == "
        "signal.SIG_IGN else 'kills', file=sys.stderr))\n"
        "assert requeue_at_exit()\n"
        "install_preemption_handler(session_stop_signals())\n"
        f"{body}\n"
        "sys.exit(0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKIT_LAUNCHER_PID", "TORCHELASTIC_RUN_ID")}
    env.update(SLURM_JOB, PATH=f"{tmp_path}:{env['PATH']}", GPUKIT_MAX_REQUEUES="3", **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


_AGREED = "mark_stop_agreed(0)  # should_stop was true: every rank saves and leaves the loop"


@pytest.mark.parametrize(("sent", "body", "requeued"), [
    ("SIGUSR2", _AGREED, True),
    ("SIGTERM", _AGREED, False),  # scancel: stop for good
    ("SIGUSR2", "pass  # the loop had ended: the warning came after the training", False),
], ids=["warning", "sigterm", "warning-after-training"])
def test_srun_python_rank_0_requeues_as_it_exits(tmp_path: Path, sent: str, body: str, requeued: bool) -> None:
    result = _srun_python_task(tmp_path, f"os.kill(os.getpid(), signal.{sent})\n{body}")
    assert result.returncode == 0, result.stderr
    assert "late warning: ignored" in result.stderr  # one while Python finalizes does not kill it (140)
    assert (tmp_path / "calls").exists() is requeued
    assert ("SLURM job 77 requeued (requeue 1 of at most 3)" in result.stderr) is requeued


def test_srun_python_whose_requeues_are_used_up_does_not_end_as_success(tmp_path: Path) -> None:
    result = _srun_python_task(tmp_path, f"os.kill(os.getpid(), signal.SIGUSR2)\n{_AGREED}", SLURM_RESTART_COUNT="3")
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr  # was 0: the job ended COMPLETED at step 6 of 60
    assert "requeued 3 time(s)" in result.stderr and not (tmp_path / "calls").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "said", "not_said"), [
    # a scheduler's warning while both workers tear down after ending their scripts by themselves: the run
    # is finished (0), not preempted (75, which under SLURM requeued the job only to find nothing left to do)
    (signal.SIGUSR2, 0, "SIGUSR2 came after the training had ended (every worker completed): nothing to stop or "
                        "requeue", "run preempted"),
    # issue 28's rule holds in the teardown too: Ctrl-C reads and exits as an interrupt (130)
    (signal.SIGINT, 130, "run interrupted (SIGINT, Ctrl-C)", "came after the training had ended"),
], ids=["scheduler-warning-is-no-preemption", "ctrl-c-is-still-an-interrupt"])
def test_a_signal_after_the_training_ended(start_run, sig: signal.Signals, code: int, said: str,
                                           not_said: str) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "30", str(SCRIPTS / "finished_teardown.py"), "{out}")
    run.files("teardown-0", "teardown-1")
    run.proc.send_signal(sig)
    assert run.wait(90) == code, run.output()
    assert said in run.output()
    assert not_said not in run.output()
    assert_none_survive(run.marker)


def test_srun_python_other_ranks_of_a_preempted_stop_end_75_before_finalizing(tmp_path: Path) -> None:
    """Issue 41.9: rank 1 of a stop agreed on the warning leaves with 75 at its last exit hook, before Python's
    finalization (where --kill-on-bad-exit's SIGTERM after rank 0's 75 killed it: 143, the job FAILED 143)."""
    body = "os.kill(os.getpid(), signal.SIGUSR2)\nmark_stop_agreed(1)"
    result = _srun_python_task(tmp_path, body, SLURM_PROCID="1", RANK="1", SLURM_NODEID="1")
    assert result.returncode == PREEMPTED_EXIT_CODE, result.stderr
    assert not (tmp_path / "calls").exists()  # rank 0 requeues, never rank 1
    scancel = _srun_python_task(tmp_path, "os.kill(os.getpid(), signal.SIGTERM)\nmark_stop_agreed(1)",
                                SLURM_PROCID="1", RANK="1", SLURM_NODEID="1")
    assert scancel.returncode == 0, scancel.stderr  # a stop for good is no preemption: the script's own exit


@pytest.mark.parametrize("rank", [0, 1])
def test_srun_python_a_rank_whose_own_warning_never_came_follows_the_agreed_preemption(tmp_path: Path,
                                                                                       rank: int) -> None:
    """The ranks agreed on a preemption another rank was warned of (should_stop's reduction carries the kind);
    this rank's own warning never came: rank 0 requeues, another rank ends 75 before finalizing (before: rank 0
    ended 0 without requeueing, the job COMPLETED unfinished; rank 1 was left to Python's finalization)."""
    body = f"from gpukit.worker import STOP_PREEMPTED\nmark_stop_agreed({rank}, STOP_PREEMPTED)"
    result = _srun_python_task(tmp_path, body, SLURM_PROCID=str(rank), RANK=str(rank), SLURM_NODEID=str(rank))
    assert result.returncode == (0 if rank == 0 else PREEMPTED_EXIT_CODE), result.stderr
    assert (tmp_path / "calls").exists() is (rank == 0)


def test_a_requeue_that_ends_the_job_at_once_still_reads_as_requeued(tmp_path: Path) -> None:
    """The requeue ends the job's processes at once, scontrol among them: one SIGTERMed before it exited read as
    "`scontrol requeue` failed: exit -15" on the 2-node test cluster although the job was requeued."""
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\nkill -TERM $$\nexit 0\n")  # requeued, then TERM
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    done = requeue_job(environment(SLURM_JOB), 3, scontrol=str(script))
    assert done.requeued, done.message
    assert (tmp_path / "calls").read_text() == "requeue 77\n"
    script.write_text("#!/bin/sh\nkill -KILL $$\n")  # a death it cannot ignore is a failure, said by its name
    killed = requeue_job(environment(SLURM_JOB), 3, scontrol=str(script))
    assert not killed.requeued and "killed by SIGKILL" in killed.message
