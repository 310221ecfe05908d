"""What runs inside every worker process, whoever started it (``gpukit run``, ``Session.launch``,
torchrun, ``srun python``): the one contract with its launcher (:class:`WorkerEnv`, what crosses
as ``GPUKIT_*`` variables), the stop flag and the signals that set it, the heartbeat, requeue at
exit, dying with the launcher, the script worker's start and exit -- and the files it leaves in
the run's directory for its launcher.

Inside workers, :func:`install_preemption_handler` turns SIGTERM into :func:`stop_requested` so a
run can checkpoint and exit with :data:`PREEMPTED_EXIT_CODE`. The launcher side is
:mod:`gpukit.launch`. Importing this package does not import torch.
"""

from __future__ import annotations

from gpukit.worker._entry import run_function
from gpukit.worker._exit_state import is_failing, leaves_a_group_at_exit, note_failure, note_group_to_leave
from gpukit.worker._env import WorkerEnv, collective_timeout_s, parse_preempt_signal, worker_env
from gpukit.worker._forked import run_forked_function
from gpukit.worker._heartbeat import start_heartbeat
from gpukit.worker._orphans import die_with_launcher
from gpukit.worker._requeue import max_requeues_from_env, requeue_after_preemption, requeue_at_exit
from gpukit.worker._run_dir import (
    BEFORE_START,
    COMPLETED,
    EarlyError,
    StopMarker,
    clear_markers,
    read_early_errors,
    checkpoints_seen,
    note_checkpoint,
    read_heartbeats,
    read_markers,
    stack_path,
    stop_markers,
)
from gpukit.worker._spawn_import import main_imported_by_gpukit
from gpukit.worker._stop import (
    PREEMPTED_EXIT_CODE,
    STOP_ASKED,
    STOP_PREEMPTED,
    agreed_stop_signal,
    clear_stop_request,
    install_preemption_handler,
    mark_stop_agreed,
    request_stop,
    stop_kind,
    stop_requested,
    stop_signal_name,
    uninstall_preemption_handler,
)
from gpukit.worker._stop_signals import is_kernel, preempt_signal, session_stop_signals

__all__ = [
    # the launcher -> worker contract
    "WorkerEnv",
    "worker_env",
    "collective_timeout_s",
    # the stop flag and the signals that set it
    "stop_requested",
    "request_stop",
    "clear_stop_request",
    "install_preemption_handler",
    "uninstall_preemption_handler",
    "stop_signal_name",
    "mark_stop_agreed",
    "stop_kind",
    "agreed_stop_signal",
    "STOP_ASKED",
    "STOP_PREEMPTED",
    "session_stop_signals",
    "is_kernel",
    "preempt_signal",
    "parse_preempt_signal",
    "PREEMPTED_EXIT_CODE",
    # the process: start, supervision, heartbeat, requeue, how it ends
    "note_failure",
    "is_failing",
    "note_group_to_leave",
    "leaves_a_group_at_exit",
    "run_function",
    "run_forked_function",
    "main_imported_by_gpukit",
    "die_with_launcher",
    "start_heartbeat",
    "requeue_at_exit",
    "requeue_after_preemption",
    "max_requeues_from_env",
    # the run's directory, read by the launcher
    "read_markers",
    "clear_markers",
    "note_checkpoint",
    "checkpoints_seen",
    "stop_markers",
    "StopMarker",
    "BEFORE_START",
    "COMPLETED",
    "read_heartbeats",
    "stack_path",
    "read_early_errors",
    "EarlyError",
]
