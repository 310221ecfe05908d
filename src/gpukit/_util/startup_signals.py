"""A scheduler's warning signal that arrives while ``gpukit run`` is still starting.

SIGUSR1/SIGUSR2 kill a process whose handler is not installed yet (their default action),
and ``gpukit run`` spends its first second importing click, torch and torch.distributed:
SLURM's ``--signal=B:USR2`` sent then used to kill the launcher with exit 140 and the job
left the queue. :func:`hold_warning_signals` (called first thing by the CLI entry point, with
nothing but the standard library imported) records such a signal instead;
the launcher acts on it (:func:`received`) once it can: stop before any worker starts and
requeue. Standard library only, so that installing it costs nothing.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["hold_warning_signals", "received", "forget"]

_WARNINGS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_received: list[int] = []


def _record(signum: int, frame: FrameType | None) -> None:
    if not _received:
        _received.append(signum)
        os.write(2, f"gpukit: {signal.Signals(signum).name} received while starting; the run will stop "
                    "before any worker starts\n".encode())


def hold_warning_signals() -> bool:
    """Record SIGUSR1/SIGUSR2 instead of dying of them, until the launcher installs its own
    handlers. Returns whether installed (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in _WARNINGS:
        if signal.getsignal(signum) in (signal.SIG_DFL, None):  # keep a handler someone chose
            signal.signal(signum, _record)
    return True


def received() -> int | None:
    """The warning signal that arrived while starting, ``None`` if none did."""
    return _received[0] if _received else None


def forget() -> None:
    """Clear the record (tests; a launcher that has acted on it)."""
    _received.clear()
