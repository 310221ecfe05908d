"""Put a preempted SLURM job back in the queue, so that it resumes from its checkpoint.

Called once per job (by ``gpukit run`` on node 0, or by rank 0 of ``srun python``) after every
rank saved and stopped because the preemption signal arrived. The number of requeues is
bounded: a job that keeps being stopped before it progresses must not loop for ever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from gpukit._util.envvars import MAX_REQUEUES_ENV
from gpukit._util.process import signal_label
from gpukit.cluster._detect import ClusterEnvironment
from gpukit.errors import ConfigurationError

__all__ = ["DEFAULT_MAX_REQUEUES", "MAX_REQUEUES_ENV", "RequeueOutcome", "requeue_job", "check_max_requeues"]

#: How often a job may be requeued (``SLURM_RESTART_COUNT``) before gpukit stops requeuing it.
DEFAULT_MAX_REQUEUES = 10

_SCONTROL_TIMEOUT_S = 30.0

# scontrol runs with SIGTERM ignored (an ignored signal stays ignored across exec): the requeue it
# asks for ends this job's processes at once, scontrol among them, and a scontrol killed before it
# exited read as "`scontrol requeue` failed: exit -15" although the job was requeued (seen on the
# 2-node test cluster). The job's teardown still ends it with SIGKILL after KillWait.
_UNTERMINATED = ("/bin/sh", "-c", 'trap "" TERM; exec "$@"', "sh")


@dataclass(frozen=True)
class RequeueOutcome:
    """What :func:`requeue_job` did: ``requeued`` and a one-line ``message`` to print."""

    requeued: bool
    message: str


def check_max_requeues(value: object, source: str = "--max-requeues") -> int:
    """``value`` as a requeue bound (an int >= 0).

    Raises:
        ConfigurationError: not a whole number >= 0.
    """
    try:
        number = int(str(value).strip())
    except ValueError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise ConfigurationError(
            f"{source} {value!r} is not a number of requeues; give a whole number >= 0 "
            f"(0: never requeue; default {DEFAULT_MAX_REQUEUES})."
        )
    return number


def requeue_job(env: ClusterEnvironment, max_requeues: int = DEFAULT_MAX_REQUEUES,
                scontrol: str | None = None) -> RequeueOutcome:
    """``scontrol requeue $SLURM_JOB_ID``, unless the job was requeued ``max_requeues`` times.

    Args:
        env: The detected environment; only a SLURM job is requeued.
        max_requeues: The bound on ``SLURM_RESTART_COUNT``.
        scontrol: The ``scontrol`` executable (default: found on ``PATH``).

    Returns:
        Whether the job was requeued, and why not when it was not (never raises: the run
        already stopped cleanly and its checkpoint is saved).
    """
    if not env.job_id or not ({"SLURM_JOB_ID", "SLURM_JOBID"} & set(env.variables)):
        return RequeueOutcome(False, "not a SLURM job: nothing to requeue; start it again to resume")
    job = env.job_id
    if env.restart_count >= max_requeues:
        return RequeueOutcome(False, (
            f"SLURM job {job} was requeued {env.restart_count} time(s), the most allowed "
            f"(--max-requeues / {MAX_REQUEUES_ENV}={max_requeues}): not requeuing. The checkpoint is "
            "saved; submit the job again to go on."
        ))
    executable = scontrol or shutil.which("scontrol")
    if executable is None:
        return RequeueOutcome(False, (
            f"cannot requeue SLURM job {job}: `scontrol` is not on PATH (inside a container?). "
            "Make SLURM's client tools available, or requeue from the batch script: "
            f"`scontrol requeue {job}`."
        ))
    try:
        wrapper = _UNTERMINATED if os.path.exists(_UNTERMINATED[0]) else ()
        done = subprocess.run([*wrapper, executable, "requeue", job], capture_output=True, text=True,
                              timeout=_SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RequeueOutcome(False, f"cannot requeue SLURM job {job}: {executable} requeue failed ({exc}).")
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        code = f"exit {done.returncode}" if done.returncode > 0 else f"killed by {signal_label(-done.returncode)}"
        return RequeueOutcome(False, (
            f"`scontrol requeue {job}` failed: {why[-1] if why else code}. "
            "Submit with --requeue (and JobRequeue allowed by the cluster), or resubmit to resume."
        ))
    return RequeueOutcome(True, (
        f"SLURM job {job} requeued (requeue {env.restart_count + 1} of at most {max_requeues}); "
        "it resumes from the checkpoint when it starts again"
    ))
