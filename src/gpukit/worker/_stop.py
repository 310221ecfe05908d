"""The worker's stop flag: SIGTERM in a worker becomes a "stop requested" flag instead of death.

A cluster that preempts a job sends SIGTERM and, a grace period later, SIGKILL. With the
handler installed, the first SIGTERM (or SIGINT) only sets a flag; the training loop sees
it at its next step boundary (a Session all-reduces it so every rank stops at the same
step), saves a checkpoint and exits 0. ``gpukit run`` then exits with
:data:`PREEMPTED_EXIT_CODE`. A second terminating signal (SIGTERM, SIGINT) falls through to
the previous handler, so an impatient user can still stop a worker that never checks the flag.
``gpukit run`` exits 75 also when only one worker was signalled: the Session leaves a
marker in the run's directory (``GPUKIT_RUN_DIR``) when its ranks agreed to stop, and the
launcher reads it. DataLoader workers ignore SIGTERM/SIGINT (``gpukit.data``), so a stop
sent to whole process groups -- as schedulers and terminals do -- reaches the training
process, not its loaders' deaths first.

A scheduler that warns before it stops a job (SLURM's ``--signal=B:USR2@90``) sends the
preemption signal (:mod:`gpukit.worker._stop_signals`: SIGUSR2 by default, ``GPUKIT_PREEMPT_SIGNAL``
to choose USR1 or TERM) which sets the same flag and never escalates (it may come twice,
and the launcher's SIGTERM follows it); :mod:`gpukit.worker._requeue` then requeues the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Union

from gpukit.monitor import emit
from gpukit.worker._env import worker_env
from gpukit.worker._run_dir import AGREED, BEFORE_START, COMPLETED, FINISHED, write_marker
from gpukit.worker._stop_signals import preempt_signal

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "install_preemption_handler",
    "uninstall_preemption_handler",
    "stop_requested",
    "request_stop",
    "clear_stop_request",
    "stop_signal_name",
    "stop_kind",
    "STOP_ASKED",
    "STOP_PREEMPTED",
    "mark_stop_agreed",
    "agreed_stop_signal",
    "stop_agreed",
    "mark_completed",
    "finish_agreed_stop",
    "install_startup_stop",
    "flush_stdio",
]

#: Exit code of ``gpukit run`` (and what a worker may exit with) when a run stopped
#: because it was asked to -- preempted -- and its workers stopped cleanly. It is
#: ``EX_TEMPFAIL`` from sysexits.h: "temporary failure, try again", so a scheduler can
#: requeue the job, which then resumes from its last checkpoint.
PREEMPTED_EXIT_CODE = 75

_Handler = Union[Callable[[int, Union[FrameType, None]], object], int, None]

_stop = threading.Event()
_previous: dict[int, _Handler] = {}
_received: list[str] = []  # name of the signal that set the flag
_terminations: set[int] = set()  # terminating signals received; another one escalates
_WARNING_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})
_agreed_rank: int | None = None  # this process's rank once its Session agreed to stop
_agreed_signal: str | None = None  # the signal the ranks agreed to stop on (see agreed_stop_signal)

#: :func:`stop_kind`'s values, ordered: the ranks agree on the highest (a warning of preemption on any
#: rank makes the whole stop a preemption, whichever rank's signal came first or at all)
STOP_ASKED, STOP_PREEMPTED = 1, 2


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # A scheduler's warning (SIGUSR1/2) may come more than once, and the launcher's SIGTERM
    # follows it: neither means "stop now". Only a second terminating signal does.
    warning = signum in _WARNING_SIGNALS
    escalate = not warning and bool(_terminations)
    if not warning:
        _terminations.add(signum)
    if not escalate:
        if not _stop.is_set():
            _stop.set()
            _received[:] = [signal.Signals(signum).name]
            # os.write, not print: a signal handler may run in the middle of another print.
            name = signal.Signals(signum).name
            rank = os.environ.get("RANK")
            who = f"rank {rank}: " if rank else ""  # no rank outside a launched job
            what = "interrupted (SIGINT)" if signum == signal.SIGINT else f"{name} received"
            os.write(2, f"gpukit: {who}{what}, stopping at the next step boundary\n".encode())
            emit("preemption", signal=name)
        return
    # Second terminating signal: behave as if we had never been installed.
    previous = _previous.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        os.kill(os.getpid(), signum)


def install_preemption_handler(signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Turn the first SIGTERM/SIGINT into a stop request (see :func:`stop_requested`).

    Args:
        signals: The signals to catch. Defaults to SIGTERM (what ``gpukit run`` and
            schedulers send) and SIGINT.

    Returns:
        ``True`` if installed; ``False`` when called off the main thread, where Python
        cannot install signal handlers (the flag can still be set with :func:`request_stop`).
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in signals:
        if signum not in _previous:
            current = signal.getsignal(signum)
            # the worker's start-up handler only covers the time before a Session exists
            _previous[signum] = signal.SIG_DFL if current is _on_startup_signal else current
        signal.signal(signum, _on_signal)
    return True


def uninstall_preemption_handler() -> None:
    """Restore the handlers that were there before :func:`install_preemption_handler`."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _previous[signum]


def stop_requested() -> bool:
    """Whether this process was asked to stop (local flag; a Session agrees on it across ranks)."""
    return _stop.is_set()


def request_stop() -> None:
    """Set the stop flag by hand, as a received SIGTERM would."""
    _stop.set()


def clear_stop_request() -> None:
    """Clear the stop flag (after a stop was handled, or between tests)."""
    global _agreed_rank, _agreed_signal
    _stop.clear()
    _received.clear()
    _terminations.clear()
    _agreed_rank = _agreed_signal = None


def stop_signal_name() -> str | None:
    """The signal that set the stop flag (``"SIGUSR2"``), ``None`` if none did."""
    return _received[0] if _received else None


def stop_kind() -> int:
    """What this process was asked: 0 nothing, :data:`STOP_ASKED` to stop (SIGTERM, SIGINT,
    :func:`request_stop`), :data:`STOP_PREEMPTED` to stop because the job is preempted (the
    preemption signal, SIGUSR2 by default). A Session's ranks agree on the highest."""
    if not _stop.is_set():
        return 0
    name = stop_signal_name()
    return STOP_PREEMPTED if name is not None and name == preempt_signal().name else STOP_ASKED


def mark_stop_agreed(rank: int, kind: int = STOP_ASKED) -> None:
    """Tell the launcher (through ``GPUKIT_RUN_DIR``) that this rank stopped because asked to.

    ``gpukit run`` then exits with :data:`PREEMPTED_EXIT_CODE` even when the workers exit 0
    and the launcher itself received no signal (a stop sent to one worker). No-op outside
    ``gpukit run``. ``kind`` is what the ranks agreed on (:func:`stop_kind`'s highest): with
    :data:`STOP_PREEMPTED` the stop is a preemption on this rank too, whether or not its own
    warning has come (:func:`agreed_stop_signal`).
    """
    global _agreed_rank, _agreed_signal
    kind = max(kind, stop_kind())
    if kind >= STOP_PREEMPTED:
        name = preempt_signal().name
    else:
        name = stop_signal_name() or "SIGTERM"
    if _agreed_rank != rank or (_agreed_signal != name and kind >= STOP_PREEMPTED):
        # should_stop may be read many times once true: write once, again only if it became a preemption
        write_marker(worker_env().run_dir, rank, name, AGREED)
        _agreed_signal = name
    _agreed_rank = rank


def agreed_stop_signal() -> str | None:
    """The signal the ranks agreed to stop on: the preemption signal when any rank was warned of a
    preemption, else this rank's own (``"SIGTERM"`` when the stop reached it only through the
    agreement); ``None`` before an agreed stop. Under ``srun python`` it decides who requeues and
    who ends 75 -- a rank's own warning may come late (SLURM signals each node's step separately)
    or never."""
    return _agreed_signal if _agreed_rank is not None else None


def finish_agreed_stop() -> bool:
    """The script ended by itself after its ranks agreed to stop: mark this rank's stop
    ``finished`` (whatever its teardown does next, the launcher counts it as clean).
    Returns whether there was an agreed stop to finish.

    A rank stops with the others even when its own signal has not come yet (SLURM's warning
    reaches each node's step separately, one node's ~0.5 s after the other's under load): that
    is a stop too, not a completed training -- marked ``completed``, its node's launcher took
    the late warning for one after the training, reported nothing, and node 0 waited
    ``--grace`` + 60 s for the report before it requeued."""
    if _agreed_rank is None:
        return False
    write_marker(worker_env().run_dir, _agreed_rank, _agreed_signal or "SIGTERM", FINISHED)
    return True


def stop_agreed() -> bool:
    """Whether this process's Session agreed to stop (``session.should_stop`` was true)."""
    return _agreed_rank is not None


def mark_completed() -> bool:
    """The script ended by itself (exit 0) with no stop asked for: its training is over. Marks it
    ``completed`` for the launcher, which then takes a later warning for a finished run. Returns
    whether marked (no stop flag, a rank known)."""
    rank = os.environ.get("RANK", "")
    if stop_requested() or not rank.isdigit():
        return False
    write_marker(worker_env().run_dir, int(rank), "-", COMPLETED)
    return True


def _distributed_started() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 - half imported: not started
        return False


def flush_open_files() -> None:
    """Flush every open buffered file the script left open: ``os._exit`` skips the teardown
    that would have flushed them, and a line the script wrote must not be lost."""
    import gc
    import io

    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): an ABC check reads obj.__class__, and torch's deprecated
            # dist.reduce_op warns when read (a FutureWarning at the end of every multi-rank run)
            if issubclass(type(obj), (io.BufferedIOBase, io.TextIOBase)) and not obj.closed and obj.writable():
                obj.flush()
        except Exception:  # noqa: BLE001 - a file that cannot be flushed now could not be later
            pass


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 - interrupted in the middle of a write: lose the rest
            pass


_startup_stopping = False  # the first stop signal is being handled: the process is ending
_startup_run_dir: str | None = None  # read when installed: a signal handler parses nothing


def _on_startup_signal(signum: int, frame: FrameType | None) -> None:
    global _startup_stopping
    if _startup_stopping:  # a second signal (the launcher's SIGTERM after SLURM's SIGUSR2) runs
        return  # inside the first handler: it is already on its way to os._exit -- one line, one marker
    _startup_stopping = True
    if _distributed_started():  # a process group but no Session: we cannot tell what would be lost
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    name = signal.Signals(signum).name
    rank = os.environ.get("RANK")
    write_marker(_startup_run_dir, int(rank or 0), name, BEFORE_START)
    whose = f"rank {rank}'s" if rank else "the"  # not "gpukit: rank N": that starts a failure summary
    os.write(2, f"gpukit: {name} received before {whose} Session started: nothing to save, stopping\n".encode())
    flush_stdio()
    os._exit(0)  # mid-import: skip the interpreter's teardown of half-imported modules


def install_startup_stop(signals: Iterable[int]) -> bool:
    """In a ``gpukit run`` worker, until its Session exists: a stop signal ends the process at
    once as a clean stop (marker ``before-start``, exit 0) -- nothing can be saved yet, and a
    worker still importing torch would otherwise die of the signal or outlive ``--grace``.

    The Session's own handler (:func:`install_preemption_handler`) replaces it. A process that
    has joined a process group without a Session is left to the signal's default action.
    Returns whether installed (main thread only).
    """
    global _startup_run_dir
    if threading.current_thread() is not threading.main_thread():
        return False
    _startup_run_dir = worker_env().run_dir
    for signum in signals:
        signal.signal(signum, _on_startup_signal)
    return True
