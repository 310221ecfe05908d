"""Workers die with their launcher, even when the launcher is SIGKILLed.

A SIGKILLed launcher runs no clean-up code, so the promise has to be made by each worker
when it starts: on Linux it asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to kill
it the moment its parent goes away; elsewhere a daemon thread polls the parent pid.
The launcher puts its pid in ``GPUKIT_LAUNCHER_PID`` so a worker whose launcher died
*before* it got this far notices and exits at once instead of running unsupervised.

What a worker starts itself (DataLoader workers, ``subprocess.Popen``) is in the worker's
process group; the launcher's :class:`Guardian` kills those groups when the launcher was
SIGKILLed (and gpukit's loader workers also ask for ``PR_SET_PDEATHSIG`` themselves).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable

from gpukit._util.envvars import LAUNCHER_PID_ENV
from gpukit._util.process import set_parent_death_signal

__all__ = ["LAUNCHER_PID_ENV", "die_with_launcher", "Guardian"]

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
    expected = os.environ.get(LAUNCHER_PID_ENV)
    parent_pid = int(expected) if expected and expected.isdigit() else os.getppid()
    armed = set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        # The launcher died between starting us and the prctl call: nobody supervises us.
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="gpukit-orphan-watch", daemon=True).start()


# The guardian: a tiny process that outlives a SIGKILLed launcher just long enough to kill the
# process groups of its workers -- where the processes a worker started itself live (loader
# workers, subprocess.Popen children without PR_SET_PDEATHSIG). It reads process-group ids on
# stdin; "done" means the launcher ended normally; end-of-file without it means the launcher
# died, and every group it was told of is SIGKILLed.
_GUARDIAN = """
import os, signal, sys
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        sys.exit(0)
    if line.isdigit():
        groups.add(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class Guardian:
    """Kills the workers' process groups if the launcher dies without cleaning up (SIGKILL).

    Use as a context manager around the run; :meth:`watch` each worker's pid (workers lead
    their own process group). Linux and macOS; a no-op where it cannot start.
    """

    def __init__(self) -> None:
        import subprocess

        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARDIAN], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True,  # a terminal's Ctrl-C is not for it
            )
        except OSError:
            self._proc = None

    def watch(self, pids: Iterable[int]) -> None:
        """Kill these process groups should the launcher die."""
        self._send("".join(f"{int(pid)}\n" for pid in pids))

    def close(self) -> None:
        """The launcher ends normally: the guardian leaves without killing anything."""
        self._send("done\n")
        if self._proc is not None:
            try:
                self._proc.stdin.close()  # type: ignore[union-attr]
                self._proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - it exits on EOF by itself
                pass
            self._proc = None

    def _send(self, text: str) -> None:
        if self._proc is None or self._proc.stdin is None or not text:
            return
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> Guardian:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
