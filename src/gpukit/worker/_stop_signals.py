"""Which signals stop a worker: the scheduler's preemption warning (``GPUKIT_PREEMPT_SIGNAL``),
the signals a Session turns into a stop request, and where it must leave them alone.

A scheduler that warns before it stops a job (SLURM's ``--signal=B:USR2@90``) sends the
preemption signal -- :func:`preempt_signal`: SIGUSR2 by default, ``GPUKIT_PREEMPT_SIGNAL`` to
choose USR1 or TERM. ``gpukit run --signal`` sets it for its workers; set it yourself for
``srun python train.py``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

from gpukit.worker._env import DEFAULT_PREEMPT_SIGNAL, WorkerEnv, worker_env

__all__ = ["preempt_signal", "session_stop_signals", "is_kernel"]

_DEFAULT = signal.Signals[f"SIG{DEFAULT_PREEMPT_SIGNAL}"]


def preempt_signal(environ: Mapping[str, str] | None = None) -> signal.Signals:
    """The preemption signal of this process: ``GPUKIT_PREEMPT_SIGNAL``, else SIGUSR2.

    Raises:
        ConfigurationError: the variable names a signal other than USR2, USR1 or TERM.
    """
    worker = worker_env() if environ is None else WorkerEnv.from_env(environ)
    return worker.preempt_signal or _DEFAULT


def session_stop_signals() -> tuple[int, ...]:
    """The signals a Session turns into a stop request in this process.

    SIGTERM and SIGINT under a launcher (``gpukit run`` sets ``GPUKIT_LAUNCHER_PID``, torchrun
    ``TORCHELASTIC_RUN_ID``; torchrun forwards Ctrl-C as SIGINT); SIGTERM alone under plain
    ``python``, where Ctrl-C should still interrupt at once. Plus the preemption signal
    (:func:`preempt_signal`) under ``gpukit run``, in a SLURM job (SLURM may send it to every
    process of the job), or when ``GPUKIT_PREEMPT_SIGNAL`` is set; elsewhere SIGUSR1/2 keep
    whatever meaning the program gives them.
    """
    from gpukit.cluster import in_slurm_job

    worker = worker_env()
    under_gpukit = worker.launcher_pid is not None
    launched = under_gpukit or bool(os.environ.get("TORCHELASTIC_RUN_ID"))
    signals = [signal.SIGTERM, signal.SIGINT] if launched else [signal.SIGTERM]
    if under_gpukit or worker.preempt_signal is not None or in_slurm_job(os.environ):
        warning = worker.preempt_signal or _DEFAULT
        if warning not in signals:
            signals.append(warning)
    return tuple(signals)


def is_kernel() -> bool:
    """Whether this process is a notebook kernel or an interactive prompt (not a launched worker).

    A Session there installs no stop-signal handler: SIGTERM means "shut the kernel down",
    and workers forked from it would inherit the handler.
    """
    interactive = "ipykernel" in sys.modules or hasattr(sys, "ps1") or bool(sys.flags.interactive)
    return interactive and worker_env().launcher_pid is None
