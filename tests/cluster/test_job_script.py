"""The documented job script (examples/slurm/train.sbatch) at the first moments of a job, no SLURM
needed: `srun` and `scontrol` are stand-ins (srun runs its command as one task of a one-node step,
scontrol writes down what it was asked), the script itself runs as sbatch runs it, and SIGUSR2
reaches it as `--signal=B:USR2` sends it: to the batch shell.

Whatever the moment, the job is requeued exactly once: by `gpukit run` (it holds the signal from
its first imports: exit 75) or, while nothing could take it (the interpreter still starting; under
`srun python` torch still importing), by the script (the step died of the signal).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from launch_helpers import MARKER_ENV, assert_none_survive, catches, poll, processes_with_marker
from slurm_helpers import EXAMPLE_JOB, SRC, TRAIN, job_script

pytestmark = pytest.mark.slow

STEP_ENV = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost"}
FALLBACK = "job script: SIGUSR2 came while gpukit could not take it"


def _tool(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _start_job(tmp_path: Path, step: str, no_task_here: bool = False,
               time_left: str | None = None) -> tuple[subprocess.Popen[str], dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exports = " ".join(f"{k}={v}" for k, v in STEP_ENV.items())
    _tool(bin_dir / "srun", f'while [[ $1 == --* ]]; do shift; done\nexport {exports}\nexec "$@"\n')
    # squeue -o %L: the job's time left, as SLURM shows it; without one, it fails as outside SLURM
    _tool(bin_dir / "squeue", f"echo '{time_left}'\n" if time_left else "exit 1\n")
    # requeue is written down; listpids fails, as where SLURM does not track the job's processes --
    # or (no_task_here) lists only the batch script: the step's task on this node is gone
    listpids = ('[[ $1 == listpids ]] && { echo "PID JOBID STEPID LOCALID GLOBALID"; echo "1 77 batch - -"; '
                'exit 0; }\n') if no_task_here else ""
    _tool(bin_dir / "scontrol", f'{listpids}[[ $1 == requeue ]] || exit 1\necho "$@" >> {tmp_path / "requeues"}\n')
    (tmp_path / "job.sh").write_text(job_script(step))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUKIT_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(SRC), SLURM_JOB_ID="77",
               **{MARKER_ENV: uuid.uuid4().hex})
    return subprocess.Popen(["bash", str(tmp_path / "job.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path), env


def _signal_after(proc: subprocess.Popen[str], delay_ms: int) -> None:
    poll(lambda: catches(proc.pid, signal.SIGUSR2), 30, "the job script to set its trap")  # its first line
    time.sleep(delay_ms / 1000)  # the moment under test, counted from there
    os.kill(proc.pid, signal.SIGUSR2)


def test_example_job_script_is_bash_and_holds_the_warning() -> None:
    subprocess.run(["bash", "-n", str(EXAMPLE_JOB)], check=True, timeout=30)
    text = EXAMPLE_JOB.read_text()
    assert "#SBATCH --signal=B:USR2@90" in text and "#SBATCH --requeue" in text
    assert "trap " in text and "srun gpukit run train.py & pid=$!" in text


# A warning that lands right at srun's start, made certain by the job sending it to itself: before
# the fork (the script passes it on once srun's pid is known) and just after it (the trap passes it
# on at once). For a moment after `&` the child is still a copy of the shell, which drops a signal
# (bash 5.2 dropped 291 of 300 sent right after `&`); so repeated, and the step is a `sleep 600`
# that only the warning ends (SIGUSR2 kills it: the script requeues).
AT_SRUN_START = {"before the fork": "kill -USR2 $$; srun sleep 600",
                 "after the fork": "srun sleep 600 & pid=$!; kill -USR2 $$ #"}


@pytest.mark.parametrize("moment", list(AT_SRUN_START))
def test_a_warning_at_sruns_start_reaches_it(tmp_path: Path, moment: str) -> None:
    for trial in range(5):
        job = tmp_path / str(trial)
        job.mkdir()
        proc, env = _start_job(job, AT_SRUN_START[moment])
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            for left in processes_with_marker(env[MARKER_ENV]):
                left.kill()
            proc.communicate()
            pytest.fail(f"trial {trial}: srun still ran 30 s after a warning {moment}: the signal was lost")
        assert proc.returncode == 128 + signal.SIGUSR2 and FALLBACK in output, (trial, proc.returncode, output)
        assert (job / "requeues").read_text().splitlines() == ["requeue 77"], (trial, output)
        assert_none_survive(env[MARKER_ENV])


@pytest.mark.parametrize("delay_ms", [0, 10, 50, 100, 200])
def test_a_warning_while_gpukit_run_starts_requeues_once(tmp_path: Path, delay_ms: int) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = f"srun {sys.executable} -m gpukit run --cpu --nproc 1 {TRAIN} {out} --ckpt {tmp_path / 'ckpt'}"
    proc, env = _start_job(tmp_path, command)
    _signal_after(proc, delay_ms)
    output = proc.communicate(timeout=240)[0]
    requeues = (tmp_path / "requeues").read_text().splitlines() if (tmp_path / "requeues").exists() else []
    assert requeues == ["requeue 77"], output  # exactly once, by gpukit run or by the script
    took_it = "received while starting" in output
    print(f"{delay_ms} ms: {'gpukit run took it' if took_it else 'the job script requeued'}")
    assert (proc.returncode == 75 and took_it) or (proc.returncode == 128 + signal.SIGUSR2 and FALLBACK in output), \
        (proc.returncode, output)
    assert not (out / "result.json").exists()  # it stopped; it did not train on
    assert_none_survive(env[MARKER_ENV])


def test_a_warning_while_srun_python_imports_requeues_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc, env = _start_job(tmp_path, f"srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} {out} --ckpt {tmp_path / 'ckpt'}")
    _signal_after(proc, 100)  # python is importing torch: nothing in it can take the signal
    output = proc.communicate(timeout=240)[0]
    assert (tmp_path / "requeues").read_text().splitlines() == ["requeue 77"], output
    assert proc.returncode == 128 + signal.SIGUSR2 and FALLBACK in output, output
    assert_none_survive(env[MARKER_ENV])


@pytest.mark.parametrize("time_left, warned", [("1:59", True), ("0-00:02:01", False)])
def test_a_job_that_starts_within_its_warning_acts_as_warned(tmp_path: Path, time_left: str, warned: bool) -> None:
    """Issue 41.8: SLURM sends --signal's warning once, up to 30 s early; one sent as the job starts, before the
    batch shell exists, is lost and the job ran into its time limit. A job that starts with its time left within
    its script's `#SBATCH --signal=B:USR2@90` (+ 30 s) acts as warned: requeued once, without starting its step
    (nothing ran that could be saved); with more time left it runs as it would have."""
    proc, env = _start_job(tmp_path, "srun sleep 600" if warned else "srun true", time_left=time_left)
    try:
        output = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        for left in processes_with_marker(env[MARKER_ENV]):
            left.kill()
        pytest.fail(f"the job ran on 30 s after starting with {time_left} left: it was not warned\n{proc.communicate()[0]}")
    requeues = (tmp_path / "requeues").read_text().splitlines() if (tmp_path / "requeues").exists() else []
    if warned:
        assert "job script: the job starts with 119 s left, within its warning (--signal ...@90" in output, output
        assert proc.returncode == 75 and requeues == ["requeue 77"], (proc.returncode, output)
    else:
        assert proc.returncode == 0 and requeues == [] and "within its warning" not in output, output
    assert_none_survive(env[MARKER_ENV])


def test_a_task_the_warning_ended_is_no_lost_node(tmp_path: Path) -> None:
    """Issue 41.10: the warning ended this node's task (before gpukit could take it) while srun waited for the
    other node's: the lost-node watchdog ended the step 30 s later and said a node was lost. Now the warning
    path lets srun go within seconds and the script requeues the job."""
    # a step that outlives the warning here (as srun waiting for the other node) while no task is on this node;
    # Ctrl-C ends it as it ends srun (bash starts a `&` child with SIGINT ignored: srun sets its own handler)
    step = (f"srun {sys.executable} -c 'import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); "
            "signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(600)'")
    proc, env = _start_job(tmp_path, step, no_task_here=True)
    _signal_after(proc, 200)
    sent = time.monotonic()
    output = proc.communicate(timeout=60)[0]
    took_s = time.monotonic() - sent
    assert "the warning ended this node's task before gpukit could take it" in output, output
    assert "waits for a lost node" not in output, output
    assert took_s < 15, (took_s, output)  # was 30 s and more
    assert (tmp_path / "requeues").read_text().splitlines() == ["requeue 77"], output
    assert_none_survive(env[MARKER_ENV])
