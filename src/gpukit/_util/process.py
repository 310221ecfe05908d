"""Process-level safety nets shared by launched workers and the loader workers they start.

- :func:`set_parent_death_signal`: ask the Linux kernel to signal this process the moment its
  parent dies (``prctl(PR_SET_PDEATHSIG)``), so nothing outlives a SIGKILLed parent;
- :func:`ignore_stop_signals`: for helper processes (DataLoader workers) whose parent handles
  SIGTERM/SIGINT as "save and stop" -- schedulers and terminals signal the whole process group,
  and a helper that died first would take the parent down before it could save.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import threading

__all__ = ["set_parent_death_signal", "ignore_stop_signals", "signal_label"]

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent thread exits.

    Returns:
        ``True`` when armed (Linux); ``False`` elsewhere or when prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT in this process (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def signal_label(signum: int) -> str:
    """``"SIGKILL"`` for 9; ``"signal 64"`` for a number no name stands for (a real-time signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
