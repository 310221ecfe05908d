"""Workers die with their launcher, even when the launcher is SIGKILLed.

A SIGKILLed launcher runs no clean-up code, so the promise has to be made by each worker
when it starts: on Linux it asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill
it the moment its parent goes away; elsewhere a daemon thread polls the parent pid.
The launcher puts its pid in ``GPUKIT_LAUNCHER_PID`` so a worker whose launcher died
*before* it got this far notices and exits at once instead of running unsupervised.
What a worker starts itself is killed by the launcher's guardian (``gpukit.launch._guardian``).
"""

from __future__ import annotations

import os
import signal
import threading

from gpukit._util.process import set_parent_death_signal
from gpukit.worker._env import worker_env

__all__ = ["die_with_launcher"]

_POLL_INTERVAL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    # Fallback where prctl is missing: a re-parented process sees a different ppid.
    stop = threading.Event()
    while not stop.wait(_POLL_INTERVAL_S):
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """Make this worker process die when the process that started it dies.

    Call first thing in a worker. Without ``GPUKIT_LAUNCHER_PID`` the current parent is
    taken as the launcher.
    """
    expected = worker_env().launcher_pid
    parent_pid = expected if expected is not None else os.getppid()
    armed = set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        # The launcher died between starting us and the prctl call: nobody supervises us.
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="gpukit-orphan-watch", daemon=True).start()
