"""The per-process services a Session starts, in one place, and stops at ``close``.

* stop signals become ``session.should_stop`` (:mod:`gpukit.worker`);
* under ``gpukit run``, a heartbeat lets the launcher name a rank that stalls;
* ``srun python`` jobs requeue themselves at exit when stopped by the scheduler's signal;
* the cluster the job runs in is announced once (rank 0, when verbose);
* the run record (``Session(record=DIR)`` or ``GPUKIT_RECORD_DIR``), when asked for.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukit.accelerators import Accelerator
    from gpukit.data import StepTimings
    from gpukit.monitor._record import Recorder
    from gpukit.precision import Precision
    from gpukit.strategies import Strategy
    from gpukit.worker import WorkerEnv

__all__ = ["SessionServices"]


class SessionServices:
    """Start the Session's process services (see the module docstring).

    Args:
        strategy, precision, accelerator: the Session's (the environment is already set up).
        timings: the Session's step-time breakdown; the recorder listens to it.
        record: the run-record directory, ``None`` for ``GPUKIT_RECORD_DIR`` or no record.
        worker: what a launcher told this process (``WorkerEnv.from_env()``).
        verbose: announce the cluster (rank 0).
    """

    def __init__(
        self, *, strategy: Strategy, precision: Precision, accelerator: Accelerator, timings: StepTimings,
        record: str | os.PathLike[str] | None, worker: WorkerEnv, verbose: bool,
    ) -> None:
        from gpukit.monitor._record import start_recorder
        from gpukit.worker import install_preemption_handler, is_kernel, requeue_at_exit, session_stop_signals

        if not is_kernel():  # a notebook kernel keeps its own SIGTERM (and its forked workers inherit none)
            install_preemption_handler(session_stop_signals())  # SIGTERM becomes `should_stop`
        if strategy.launched:  # under gpukit run: the launcher names a rank that stalls
            from gpukit.worker import start_heartbeat

            start_heartbeat(strategy.rank, strategy.world_size)
        requeue_at_exit()  # `srun python`: rank 0 requeues a job stopped by --signal, at exit
        if verbose:
            from gpukit.cluster import announce

            # once, rank 0: the SLURM / Kubernetes job this process belongs to (its gpukit launcher said it)
            announce(under_gpukit=worker.launcher_pid is not None)
        #: the run recorder, ``None`` unless recording
        self.recorder: Recorder | None = start_recorder(
            record if record is not None else worker.record_dir,
            strategy=strategy, precision=precision, accelerator=accelerator, timings=timings,
        )

    def log(self, scalars: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder.log(**scalars)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
