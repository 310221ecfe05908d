"""After a preemption: put the SLURM job back in the queue, once, from the right process.

The preemption signal (``--signal``, default SIGUSR2) sets the stop flag; every rank saves at
its next step and exits. Then one process requeues the job (``scontrol requeue``, see
:func:`gpukit.cluster.requeue_job`):

* under ``srun gpukit run``: the ``gpukit run`` of node 0, once its workers stopped cleanly;
* under ``srun python train.py`` (no launcher): rank 0, as it exits, if its ranks agreed to stop
  (:func:`requeue_at_exit`).

Only a stop caused by the preemption signal requeues: Ctrl-C or ``scancel`` (SIGTERM) ends
the job for good.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable

from gpukit.cluster import DEFAULT_MAX_REQUEUES, ClusterEnvironment, RequeueOutcome, environment, requeue_job
from gpukit.worker._env import worker_env
from gpukit.worker._stop import PREEMPTED_EXIT_CODE, agreed_stop_signal, flush_open_files, flush_stdio, stop_agreed
from gpukit.worker._stop_signals import preempt_signal

__all__ = ["requeue_after_preemption", "requeue_at_exit", "max_requeues_from_env"]


def max_requeues_from_env() -> int:
    """``GPUKIT_MAX_REQUEUES``, else the default (10).

    Raises:
        ConfigurationError: not a whole number >= 0.
    """
    limit = worker_env().max_requeues
    return DEFAULT_MAX_REQUEUES if limit is None else limit


def requeue_after_preemption(
    signal_name: str | None,
    preempt: signal.Signals,
    *,
    max_requeues: int,
    env: ClusterEnvironment | None = None,
    echo: Callable[[str], None] | None = None,
) -> RequeueOutcome | None:
    """Requeue the job if this stop came from ``preempt`` and this process speaks for the job.

    Args:
        signal_name: The signal that stopped the run (``"SIGUSR2"``), ``None`` if none.
        preempt: The preemption signal.
        max_requeues: Bound on ``SLURM_RESTART_COUNT``.
        env: The detected environment (default: detect now).
        echo: Where to print the outcome (default stderr).

    Returns:
        The outcome, or ``None`` when nothing was to be done here (another signal, not a SLURM
        job, not rank 0 / node 0).
    """
    if signal_name != preempt.name:
        return None
    env = env if env is not None else environment()
    if env.rank != 0 or not env.job_id or not ({"SLURM_JOB_ID", "SLURM_JOBID"} & set(env.variables)):
        return None
    outcome = requeue_job(env, max_requeues)
    (echo or _stderr)(f"gpukit: {outcome.message}")
    return outcome


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_armed = False


def requeue_at_exit(env: ClusterEnvironment | None = None) -> bool:
    """Under ``srun python`` (no launcher): arm what happens at this task's exit. Returns whether
    armed (once per process, SLURM tasks only).

    Arm it before the process group exists: its exit hook then runs after the Session's (which
    leaves the group), last of all. There, on every rank, a later warning is ignored -- the run
    is over, and Python would restore SIGUSR2's default action (death, 140, the job FAILED) while
    it finalizes. Rank 0 requeues the job if its ranks agreed to stop on the preemption signal
    (never for a warning that came after the training); a requeue that does not happen (the
    bound used up, ``scontrol`` refused) ends rank 0 with exit 75, as ``gpukit run`` does, so
    that the job does not end COMPLETED with its training unfinished. The other ranks of such a
    stop end 75 there too, without Python's finalization (srun's exit is its tasks' highest).
    """
    global _armed
    env = env if env is not None else environment()
    if _armed or worker_env().launcher_pid is not None or env.kind != "slurm" or not env.in_step:
        return False
    atexit.register(_at_exit, env, preempt_signal(), max_requeues_from_env())
    _armed = True
    return True


def _at_exit(env: ClusterEnvironment, preempt: signal.Signals, limit: int) -> None:
    signal.signal(preempt, signal.SIG_IGN)  # kept as it is through the interpreter's finalization
    if not stop_agreed():
        return
    # the signal the ranks agreed on, not this rank's own: that may come late (SLURM signals each node's step
    # separately) or never, and a rank stopped by the agreement alone ended by Python's finalization
    # (143 after rank 0's 75), or rank 0 did not requeue
    agreed = agreed_stop_signal()
    if env.rank != 0:
        if agreed == preempt.name:
            # every rank of a preempted srun-python job ends 75 at once, not in Python's finalization: there
            # the handlers are reset, and --kill-on-bad-exit's SIGTERM after rank 0's 75 killed the others
            # with 143 -- srun's exit, the job FAILED 143 and the job script took the warning for lost
            # (issue 41.9)
            _leave(PREEMPTED_EXIT_CODE)
        return
    outcome = requeue_after_preemption(agreed, preempt, max_requeues=limit, env=env)
    if outcome is not None and not outcome.requeued:
        _leave(PREEMPTED_EXIT_CODE)


def _leave(code: int) -> None:
    flush_open_files()
    flush_stdio()
    os._exit(code)  # the last hook: the process group is left already
