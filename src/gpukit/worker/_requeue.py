"""After a preemption: put the SLURM job back in the queue, once, from the right process.

The preemption signal (``--signal``, default SIGUSR2) sets the stop flag; every rank saves at
its next step and exits. Then one process requeues the job (``scontrol requeue``, see
:func:`gpukit.cluster.requeue_job`):

* under ``srun gpukit run``: the ``gpukit run`` of node 0, once its workers stopped cleanly;
* under ``srun python train.py`` (no launcher): rank 0, as it exits (:func:`requeue_at_exit`).

Only a stop caused by the preemption signal requeues: Ctrl-C or ``scancel`` (SIGTERM) ends
the job for good.
"""

from __future__ import annotations

import atexit
import signal
import sys
from collections.abc import Callable

from gpukit.cluster import DEFAULT_MAX_REQUEUES, ClusterEnvironment, RequeueOutcome, environment, requeue_job
from gpukit.worker._env import WorkerEnv
from gpukit.worker._stop import stop_requested, stop_signal_name
from gpukit.worker._stop_signals import preempt_signal

__all__ = ["requeue_after_preemption", "requeue_at_exit", "max_requeues_from_env"]


def max_requeues_from_env() -> int:
    """``GPUKIT_MAX_REQUEUES``, else the default (10).

    Raises:
        ConfigurationError: not a whole number >= 0.
    """
    limit = WorkerEnv.from_env().max_requeues
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
    """Under ``srun python`` (no launcher), rank 0 requeues the job as it exits after a
    preemption. Returns whether the exit hook was armed (once per process)."""
    global _armed
    env = env if env is not None else environment()
    if _armed or WorkerEnv.from_env().launcher_pid is not None or env.kind != "slurm" or not env.in_step or env.rank != 0:
        return False
    preempt = preempt_signal()
    limit = max_requeues_from_env()
    atexit.register(
        lambda: stop_requested() and requeue_after_preemption(stop_signal_name(), preempt, max_requeues=limit, env=env)
    )
    _armed = True
    return True
