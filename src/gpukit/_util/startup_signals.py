"""A stop signal that arrives while ``gpukit run`` is still starting.

SIGUSR1/SIGUSR2/SIGTERM kill a process whose handler is not installed yet (their default
action), and ``gpukit run`` spends its first seconds (on a busy machine: 15) importing click,
torch and torch.distributed: SLURM's ``--signal=B:USR2`` sent then used to kill the launcher
with exit 140 and the job left the queue. :func:`hold_warning_signals` (called first thing by
the CLI entry point, with nothing but the standard library imported) records such a signal
instead; the launcher acts on it (:func:`received`) once it can: it stops before any worker
starts, exits 75 and, for the preemption signal, requeues. A second SIGTERM still kills at once.
Standard library only, so that installing it costs nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["HELD_SIGNALS", "hold_warning_signals", "received", "forget", "mark_started"]

#: What the CLI entry point holds while ``gpukit run`` starts.
HELD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2", "SIGTERM") if hasattr(signal, name))
_received: list[int] = []
_started: list[bool] = []  # once the launcher's own handlers took over (workers may start)


def _record(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGTERM and signum in _received:  # asked twice: stop now, as by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _received and not _started:  # after the run (its handlers restored): the exit is near
        os.write(2, f"gpukit: {signal.Signals(signum).name} received while starting; the run will stop "
                    "before any worker starts\n".encode())
    _received.append(signum)


def hold_warning_signals() -> bool:
    """Record SIGUSR1/SIGUSR2/SIGTERM instead of dying of them, until the launcher installs its
    own handlers. Returns whether installed (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in HELD_SIGNALS:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):  # keep a handler someone chose
            signal.signal(signum, _record)
    return True


def received() -> int | None:
    """The warning signal that arrived while starting, ``None`` if none did."""
    return _received[0] if _received else None


def mark_started() -> None:
    """The launcher's own handlers are in place: what this module records from now on (after
    they are restored, while the launcher finishes) is no longer a stop "while starting"."""
    _started.append(True)


def forget() -> None:
    """Clear the record (tests; a launcher that has acted on it)."""
    _received.clear()
