"""The per-process services a Session starts, in one place, and stops at ``close``.

* stop signals become ``session.should_stop`` (:mod:`gpukit.worker`);
* under ``gpukit run``, a heartbeat lets the launcher name a rank that stalls;
* the cluster the job runs in is announced once (rank 0, when verbose);
* the run record (``Session(record=DIR)`` or ``GPUKIT_RECORD_DIR``), when asked for;
* the experiment trackers of ``Session(log_with=...)`` (rank 0; :mod:`gpukit.monitor._tracking`).

``log`` sends ``session.log`` scalars to both; ``log_default`` the ones gpukit logs by itself (the
loss given to ``backward``, the gradient norm), which a value the user logs under the same name
replaces.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukit.accelerators import Accelerator
    from gpukit.data import StepTimings
    from gpukit.monitor import Recorder, TrackerHub
    from gpukit.session._config import SessionConfig
    from gpukit.strategies import Strategy
    from gpukit.worker import WorkerEnv

__all__ = ["SessionServices"]


class SessionServices:
    """Start the Session's process services (see the module docstring).

    Args:
        strategy, accelerator: the Session's (the environment is already set up; the precision is the strategy's).
        timings: the Session's step-time breakdown; the recorder listens to it.
        config: the Session's settings: ``record`` (the run-record directory, ``None`` for
            ``GPUKIT_RECORD_DIR`` or no record), ``verbose`` (announce the cluster on rank 0), ``log_with``
            (the experiment trackers); logged once with each tracker's run (:meth:`SessionConfig.tracked`).
        worker: what a launcher told this process (``worker_env()``).
        accumulate_grad_batches: micro-batches per step, as worked out (logged with the settings).
    """

    def __init__(
        self, *, strategy: Strategy, accelerator: Accelerator, timings: StepTimings, config: SessionConfig,
        worker: WorkerEnv, accumulate_grad_batches: int = 1,
    ) -> None:
        from gpukit.monitor import RecordedRank, start_recorder
        from gpukit.worker import install_preemption_handler, is_kernel, session_stop_signals

        if not is_kernel():  # a notebook kernel keeps its own SIGTERM (and its forked workers inherit none)
            install_preemption_handler(session_stop_signals())  # SIGTERM becomes `should_stop`
        if strategy.launched:  # under gpukit run: the launcher names a rank that stalls
            from gpukit.worker import start_heartbeat

            start_heartbeat(strategy.rank, strategy.world_size)
        if config.verbose:
            from gpukit.cluster import announce

            # once, rank 0: the SLURM / Kubernetes job this process belongs to (its gpukit launcher said it)
            announce(under_gpukit=worker.launcher_pid is not None)
        #: the run recorder, ``None`` unless recording (a launched session given a directory)
        self.recorder: Recorder | None = None
        directory = config.record if config.record is not None else worker.record_dir
        if directory is not None and strategy.launched:
            who = RecordedRank(rank=strategy.rank, world_size=strategy.world_size, local_rank=strategy.local_rank,
                               device=strategy.root_device, strategy=strategy.describe(),
                               precision=strategy.precision.name)
            self.recorder = start_recorder(directory, who, accelerator)
            timings.add_listener(self.recorder.on_step)
        from gpukit.monitor import TrackerHub, make_trackers

        trackers = make_trackers(config.log_with)  # checked on every rank: the same error everywhere
        logged = config.tracked(strategy=strategy.describe(), precision=strategy.precision.name,
                                world_size=strategy.world_size, accumulate_grad_batches=accumulate_grad_batches)
        self.trackers: TrackerHub = TrackerHub(trackers, rank=strategy.rank, settings=logged,
                                               directory=self.recorder.directory if self.recorder is not None else None)
        self._settings = logged  # the trackers' own dict: what they log when they start

    def precision_chosen(self, name: str, was: str) -> None:
        """``Session(fit=...)`` changed the precision at setup to ``name``: the record's header and the
        trackers' settings said ``was``. The record gets a ``precision`` event (the report then shows
        ``name``); trackers not started yet log ``name`` with their settings."""
        self._settings["precision"] = name
        if self.recorder is not None:
            self.recorder.on_event("precision", time.time(), {"precision": name, "was": was, "chosen_by": "fit"})

    @property
    def logging(self) -> bool:
        """Whether logged scalars go anywhere (a record or a tracker)."""
        return self.recorder is not None or self.trackers.active

    def log(self, scalars: dict[str, Any], step: int) -> None:
        from gpukit.monitor import check_scalar

        scalars = {name: check_scalar(name, value) for name, value in scalars.items()}  # even when not logging
        if self.recorder is not None:
            self.recorder.log(**scalars)
        self.trackers.log(step, scalars)

    def log_default(self, scalars: dict[str, Any], step: int) -> None:
        if self.recorder is not None:
            self.recorder.log_default(**scalars)
        self.trackers.log(step, scalars, default=True)

    def close(self) -> None:
        self.trackers.close()
        if self.recorder is not None:
            self.recorder.close()

