"""The one place that drives ``torch.distributed.elastic`` -- the engine behind torchrun.

Scripts and Python functions both run as a worker group of a ``LocalElasticAgent``
subclass behind a c10d rendezvous: on one machine the rendezvous store and the workers'
store listen on port 0 (the OS picks a free port, so runs side by side never collide);
across machines node 0 hosts the rendezvous at ``--master-addr:--master-port``.

What gpukit changes in the agent, and why:
- every stop is SIGTERM, then SIGKILL after ``grace_s`` -- elastic would forward SIGINT
  as SIGINT and wait a fixed 30 s when a worker fails;
- a further Ctrl-C during that grace period kills the workers at once instead of
  aborting the shutdown half way;
- exit codes are kept after a stop, to tell a clean preemption from a kill.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, cast

from gpukit.errors import LaunchError
from gpukit.launch._guardian import Guardian
from gpukit.launch._notebook import frozen_heap
from gpukit.launch._rendezvous import (
    cheaper_rendezvous,
    fresh_store_per_round,
    grow_at_checkpoints,
    rendezvous_error,
    rendezvous_parameters,
    rendezvous_where,
)
from gpukit.launch._signals import (
    RunInterruptedError,
    StopSignal,
    escalate_on_signal,
    kill_now,
    launcher_signals,
    worker_stop_signal,
)
from gpukit.launch._spec import LaunchSpec
from gpukit.launch._stall import Stall, StallMonitor, stall_threshold_s
from gpukit.launch._stop_report import interrupted_outcome, report_stop, training_completed
from gpukit.launch._summary import WorkerFailedError, WorkerFailure, with_early_errors
from gpukit.launch._topology import Topology
from gpukit.worker import (
    PREEMPTED_EXIT_CODE,
    WorkerEnv,
    clear_markers,
    collective_timeout_s,
    read_early_errors,
    stop_markers,
)

__all__ = ["run_workers"]

_MONITOR_INTERVAL_S = 0.1


def _import_torch_quietly(verbose: bool) -> None:
    # libtorch reads TORCH_CPP_LOG_LEVEL once, at import: keep the launcher's C++ store
    # retries (with 40-line stack dumps) off the terminal -- gpukit reports the outcome.
    # Not exported to the workers: their own C++ warnings stay visible.
    if verbose or "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


@contextmanager
def _environ(updates: Mapping[str, str]) -> Iterator[None]:
    # Workers inherit the launcher's environment (scripts via Popen, functions via spawn),
    # so settings for them go into os.environ for the run's duration only.
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _quiet_torch_logs(verbose: bool) -> Iterator[None]:
    # Elastic logs every step at WARNING, and whole tracebacks for a failed worker; the
    # summary says what matters. --verbose keeps them.
    if verbose:
        yield
        return
    # the agent's modules set their loggers to WARNING when imported: import them first, or the agent's
    # "Received 15 death signal, shutting down workers" reaches a scancel'ed job's log (issue 41.11)
    import torch.distributed.elastic.agent.server.api  # noqa: F401
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401

    loggers = [
        logger
        for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger)
    ]
    saved = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in saved.items():
            logger.setLevel(level)


def _exit_codes(pcontext: Any) -> dict[int, int | None]:
    handlers = getattr(pcontext, "subprocess_handlers", None)  # script workers
    if handlers:
        return {rank: handler.proc.returncode for rank, handler in handlers.items()}
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)  # function workers
    if processes:
        return {rank: proc.exitcode for rank, proc in enumerate(processes)}
    return {}


def _make_agent_class() -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class GpukitAgent(LocalElasticAgent):  # type: ignore[misc]
        """LocalElasticAgent whose every stop is SIGTERM, ``grace_s``, SIGKILL."""

        def __init__(self, spec: Any, logs_specs: Any, grace_s: float, preempt_signal: int | None,
                     run_dir: str, start_method: str = "spawn") -> None:
            super().__init__(spec, logs_specs=logs_specs, start_method=start_method)
            self.run_dir = run_dir
            self.start_method = start_method
            self.grace_s = grace_s
            self.preempt_signal = preempt_signal
            self.attempts = 0
            self.exit_codes: dict[int, int | None] = {}
            self.failed_before_stop: set[int] | None = None  # local ranks, set at the first stop
            self.guardian = Guardian()

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            clear_markers(self.run_dir)  # a restarted group: the stops and heartbeats of the one it replaces are over
            with frozen_heap() if self.start_method == "fork" else nullcontext():
                pids = super()._start_workers(worker_group)
            self.guardian.watch(pids.values())  # their process groups die even if we are SIGKILLed
            self.attempts += 1
            self.exit_codes, self.failed_before_stop = {}, None
            pcontext = self._pcontext
            close = pcontext.close

            # The agent closes the workers from several places (a failed worker, a signal,
            # a restart), some with a fixed 30 s timeout; all go through here instead.
            def graceful_close(death_sig: Any = None, timeout: float = 30) -> None:
                # who had already ended badly before the launcher stopped anyone: the root cause
                # (a SIGKILL from the OOM killer reads the same as the launcher's own SIGKILL)
                if self.failed_before_stop is None:  # the first close; the agent may close twice
                    self.failed_before_stop = {
                        local for local, code in _exit_codes(pcontext).items() if code not in (None, 0)
                    }
                with escalate_on_signal(lambda: kill_now(pcontext.pids().values()), self.preempt_signal):
                    # SIGINT after a Ctrl-C (torch's handler passes it as death_sig; ours records it), else SIGTERM
                    stop = signal.SIGINT if death_sig == signal.SIGINT else worker_stop_signal()
                    close(stop, self.grace_s)
                self.exit_codes = _exit_codes(pcontext)

            pcontext.close = graceful_close
            return pids

        def _exit_barrier(self) -> None:
            # torch's agent waits here (up to 300 s) for every node's workers to end. After a stop
            # the workers agreed on, the nodes meet in report_stop instead: node 0 waits there for
            # every node's report, and a node whose own signal never came (its workers stopped with
            # the others) held that report back in this barrier -- which node 0, stopped by its signal,
            # never enters -- until node 0 gave up after --grace + 60 s (issue 41)
            if stop_markers(self.run_dir):
                return
            super()._exit_barrier()

        def stopped_cleanly(self) -> bool:
            codes = self.exit_codes
            return bool(codes) and all(code in (0, PREEMPTED_EXIT_CODE) for code in codes.values())

    return GpukitAgent


def _failure(rank: int, failure: Any, sequence: int = 0, first: set[int] | None = None) -> WorkerFailure:
    message = failure.message
    error = traceback = None
    if isinstance(message, dict):
        error = message.get("message")
        traceback = message.get("extraInfo", {}).get("py_callstack")
    return WorkerFailure(
        rank=int(rank),
        local_rank=int(failure.local_rank),
        pid=int(failure.pid),
        exitcode=int(failure.exitcode),
        error=error,
        traceback=traceback,
        timestamp=float(failure.timestamp),
        sequence=sequence,
        before_stop=int(failure.local_rank) in (first or set()),
    )


def _stderr_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _stalled(failure: WorkerFailure, stalls: Mapping[int, Stall]) -> WorkerFailure:
    stall = stalls.get(failure.rank)
    if stall is None:
        return failure
    if failure.error:  # it stalled, then raised an error of its own: that says more
        return dataclasses.replace(failure, stalled=stall.message())
    return dataclasses.replace(failure, stalled=stall.message(), traceback=stall.stack or None)


def _rendezvous_handler(topology: Topology, run_id: str, grace_s: float, min_nodes: int | None = None) -> Any:
    """This node's rendezvous handler; a stop or a failure while reaching it is the run's error."""
    from torch.distributed.elastic.rendezvous import RendezvousError, registry

    try:
        handler = registry.get_rendezvous_handler(rendezvous_parameters(topology, run_id, min_nodes))
        # every round's workers (a restart, a node lost or back) start on an empty store
        return fresh_store_per_round(handler)
    except StopSignal as exc:  # stopped while still reaching the master: no worker ran
        raise RunInterruptedError(exc.signum, preempted=True, grace_s=grace_s,
                                  detail="no worker had started yet, nothing to save") from None
    except (RendezvousError, RuntimeError, ValueError, TimeoutError) as exc:
        raise rendezvous_error(exc, topology) from exc


def _agent(entrypoint: Callable[..., Any] | str, args: tuple[Any, ...], nproc: int, handler: Any, spec: LaunchSpec,
           log_dir: str, run_dir: str, start_method: str) -> Any:
    """The elastic agent of ``nproc`` workers (gpukit's subclass: see the module docstring)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    worker_spec = WorkerSpec(
        role="worker",
        local_world_size=nproc,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=spec.max_restarts,
        monitor_interval=_MONITOR_INTERVAL_S,
    )
    return _make_agent_class()(worker_spec, DefaultLogsSpecs(log_dir=log_dir), spec.grace_s, spec.preempt_signal,
                               run_dir, start_method)


def _failed(result: Any, agent: Any, stalls: Mapping[int, Stall], run_dir: str) -> WorkerFailedError:
    """The error of a failed run: every failed rank, the first failure first, stalls named, and the
    error a worker that died before its Session was up left in the run's directory."""
    # elastic records failures in the order it found them: the real one first,
    # then the workers it stopped (timestamps alone have 1 s resolution)
    failures = [
        _stalled(_failure(rank, failure, sequence, agent.failed_before_stop or set()), stalls)
        for sequence, (rank, failure) in enumerate(result.failures.items())
    ]
    return WorkerFailedError(with_early_errors(failures, read_early_errors(run_dir)), attempts=agent.attempts)


def run_workers(
    entrypoint: Callable[..., Any] | str,
    args: tuple[Any, ...],
    spec: LaunchSpec,
    *,
    nproc: int,
    env: Mapping[str, str],
    worker: WorkerEnv,
    run_id: str,
    start_method: str = "spawn",
) -> dict[int, Any]:
    """Start ``nproc`` workers on this node under the elastic agent and supervise them.

    Args:
        entrypoint: A picklable function, or an executable (``sys.executable``).
        args: Arguments for the function / command line for the executable.
        spec: The launch: its ``topology`` (decided: single machine or this node's place among
            several), ``max_restarts`` (restarts of the whole worker group after a failure),
            ``grace_s`` (seconds between SIGTERM and SIGKILL whenever workers are stopped),
            ``verbose`` (keep torch elastic's own log lines) and ``preempt_signal`` (the
            scheduler's preemption warning, e.g. SIGUSR2: stops the run like SIGTERM -- workers
            get SIGTERM, save, exit; repeated, it changes nothing).
        nproc: Workers on this node.
        env: Extra environment for the workers (on top of the launcher's and torchrun's).
        worker: What every worker is told (the run's directory is added here).
        run_id: Rendezvous id; every node of a run must use the same one.
        start_method: ``"spawn"``, or ``"fork"`` for function workers launched from a notebook
            (see ``_notebook.py``).

    Returns:
        Return values by global rank (``None`` for script workers).

    Raises:
        WorkerFailedError: a worker failed (after all restarts); names the rank and error.
        RunInterruptedError: the launcher got Ctrl-C/SIGTERM; its ``preempted`` says
            whether the workers stopped cleanly. Also (``preempted`` true) when script workers
            all exited cleanly after their Sessions agreed to stop on a signal one of them got.
        LaunchError: the rendezvous could not be reached or completed.
    """
    topology, grace_s = cast(Topology, spec.topology), spec.grace_s
    _import_torch_quietly(spec.verbose)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError

    log_dir = tempfile.mkdtemp(prefix="gpukit-run-")
    run_dir = os.path.join(log_dir, "run")  # GPUKIT_RUN_DIR: the workers' stop markers
    os.mkdir(run_dir)
    env = {**env, **dataclasses.replace(worker, run_dir=run_dir).to_env()}
    try:
        with _environ(env), _quiet_torch_logs(spec.verbose), launcher_signals(spec.preempt_signal), \
                cheaper_rendezvous(topology.single_machine):
            # 1. reach the rendezvous (node 0 hosts it), then start the workers under the agent
            handler = _rendezvous_handler(topology, run_id, grace_s, spec.min_nodes)
            if spec.min_nodes is not None:  # a returning node joins at the workers' next checkpoint
                handler = grow_at_checkpoints(handler, run_dir, topology.rdzv_timeout_s / 2)
            agent = _agent(entrypoint, args, nproc, handler, spec, log_dir, run_dir, start_method)
            close_rendezvous = True
            monitor = StallMonitor(run_dir, stall_threshold_s(collective_timeout_s()), _stderr_line)
            try:
                with monitor, agent.guardian:  # names a rank that stalls; kills orphans if we die
                    result = agent.run()
            except (StopSignal, SignalException) as exc:
                # Like torchrun: a stopped node leaves the rendezvous open for the others.
                close_rendezvous = False
                signum = exc.signum if isinstance(exc, StopSignal) else int(exc.sigval)
                # a scheduler's stop after every worker completed: the run is finished (0, no requeue);
                # Ctrl-C stays an interrupt (130) whenever it comes
                if (signum != signal.SIGINT and isinstance(entrypoint, str)
                        and training_completed(agent, run_dir, nproc)):
                    _stderr_line(f"gpukit: {signal.Signals(signum).name} came after the training had ended "
                                 "(every worker completed): nothing to stop or requeue")
                    return {}
                interrupted = interrupted_outcome(signum, agent, run_dir, nproc, grace_s)
                report_stop(interrupted, handler, topology, run_id, interrupted.signal_name, grace_s, _stderr_line,
                            agent, spec.preempt_signal)
                raise interrupted from None
            except RendezvousError as exc:
                raise rendezvous_error(exc, topology) from exc
            finally:
                if close_rendezvous:
                    try:
                        handler.shutdown()
                    except Exception:  # noqa: BLE001 - the run's outcome matters more
                        pass
            # 2. the outcome: the workers' results, a failure, or a stop the workers agreed on
            if result is None:  # the rendezvous was closed by another node
                raise LaunchError(f"{rendezvous_where(topology)} was closed by another node before this one finished.")
            if result.is_failed():
                raise _failed(result, agent, monitor.stalls, run_dir)
            markers = stop_markers(run_dir)
            if markers and isinstance(entrypoint, str):
                # a worker was told to stop (not the launcher) and the ranks agreed: preempted
                signum = getattr(signal, next(iter(markers.values())), signal.SIGTERM)
                interrupted = RunInterruptedError(signum, preempted=True, grace_s=grace_s)
                report_stop(interrupted, handler, topology, run_id, None, grace_s, _stderr_line, agent,
                            spec.preempt_signal)
                raise interrupted
            return dict(result.return_values)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
