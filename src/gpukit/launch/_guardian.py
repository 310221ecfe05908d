"""The launcher's guardian: the workers' process groups die with the launcher, even when the
launcher is SIGKILLed.

A SIGKILLed launcher runs no clean-up code. Each worker makes its own promise when it starts
(:func:`gpukit.worker.die_with_launcher`: the kernel kills it when its parent goes away), but
what a worker starts itself (DataLoader workers, ``subprocess.Popen``) is in the worker's
process group; the launcher's :class:`Guardian` kills those groups when the launcher was
SIGKILLed (and gpukit's loader workers also ask for ``PR_SET_PDEATHSIG`` themselves).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["Guardian"]

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
