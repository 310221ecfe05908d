"""Preemption: SIGTERM in a worker becomes a "stop requested" flag instead of death.

A cluster that preempts a job sends SIGTERM and, a grace period later, SIGKILL. With the
handler installed, the first SIGTERM (or SIGINT) only sets a flag; the training loop sees
it at its next step boundary (a Session all-reduces it so every rank stops at the same
step), saves a checkpoint and exits 0. ``gpukit run`` then exits with
:data:`PREEMPTED_EXIT_CODE`. A second signal falls through to the previous handler, so an
impatient user can still stop a worker that never checks the flag.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Union

from gpukit.monitor._events import emit

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "install_preemption_handler",
    "uninstall_preemption_handler",
    "stop_requested",
    "request_stop",
    "clear_stop_request",
]

#: Exit code of ``gpukit run`` (and what a worker may exit with) when a run stopped
#: because it was asked to -- preempted -- and its workers stopped cleanly. It is
#: ``EX_TEMPFAIL`` from sysexits.h: "temporary failure, try again", so a scheduler can
#: requeue the job, which then resumes from its last checkpoint.
PREEMPTED_EXIT_CODE = 75

_Handler = Union[Callable[[int, Union[FrameType, None]], object], int, None]

_stop = threading.Event()
_previous: dict[int, _Handler] = {}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if not _stop.is_set():
        _stop.set()
        # os.write, not print: a signal handler may run in the middle of another print.
        name = signal.Signals(signum).name
        rank = os.environ.get("RANK")
        who = f"rank {rank}: " if rank else ""  # no rank outside a launched job
        os.write(2, f"gpukit: {who}{name} received, stopping at the next step boundary\n".encode())
        emit("preemption", signal=name)
        return
    # Second signal: behave as if we had never been installed.
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
            _previous[signum] = signal.getsignal(signum)
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
    _stop.clear()
