"""A short failure summary: which rank failed first, with what error, where.

The elastic agent reports every worker that ended badly, including the healthy ones it
stopped itself after the real failure, and picks the "root cause" by a timestamp with
one-second resolution. Here the root cause is the failure that carries an error
(a traceback from the worker's error file, or a non-zero exit code) rather than a
SIGTERM/SIGKILL that the launcher sent, then the earliest, then the first the agent found
(it records the failed worker before it stops the others: a worker SIGKILLed from outside
comes before the workers the launcher then SIGTERMed, even within the same second), then
the lowest rank.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from gpukit.errors import LaunchError
from gpukit.launch._preemption import PREEMPTED_EXIT_CODE

__all__ = ["WorkerFailure", "WorkerFailedError", "order_failures", "format_summary"]

# Signals the launcher itself sends when it stops the other workers.
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGKILL)}
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly.

    Attributes:
        rank: Global rank.
        local_rank: Rank on its node.
        pid: Process id.
        exitcode: Exit code; negative ``-N`` when killed by signal ``N``.
        error: ``"ZeroDivisionError: division by zero"`` when the worker recorded one.
        traceback: The worker's Python traceback when it recorded one.
        timestamp: Seconds since the epoch when the failure was recorded.
        sequence: Position in the order the agent found the failures (0 first); breaks
            ties between timestamps, which elastic keeps in whole seconds.
    """

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    error: str | None = None
    traceback: str | None = None
    timestamp: float = 0.0
    sequence: int = 0

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` for ``exitcode == -9``; ``None`` when it exited normally."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def location(self) -> str | None:
        """``"train.py:12 in step"`` -- the innermost frame of the traceback, if any."""
        frames = _FRAME_RE.findall(self.traceback or "")
        if not frames:
            return None
        file, line, func = frames[-1]
        return f"{file}:{line} in {func}"

    def describe(self) -> str:
        """One line: what happened to this worker."""
        if self.error:
            return self.error
        if self.signal_name:
            return f"killed by {self.signal_name}"
        return f"exited with code {self.exitcode}"


def _priority(failure: WorkerFailure) -> int:
    if failure.error:
        return 0
    if failure.exitcode == PREEMPTED_EXIT_CODE:  # stopped as asked: like a launcher's stop
        return 3
    if failure.exitcode > 0:
        return 1
    if -failure.exitcode not in _STOP_SIGNALS:  # e.g. SIGSEGV, SIGABRT: the worker's own doing
        return 2
    return 3


def order_failures(failures: Iterable[WorkerFailure]) -> list[WorkerFailure]:
    """Root cause first: recorded error > exit code > other signal > stopped by the launcher.

    Within each kind: earliest timestamp, then the order the agent found them, then rank.
    """
    return sorted(failures, key=lambda f: (_priority(f), f.timestamp, f.sequence, f.rank))


def format_summary(failures: Iterable[WorkerFailure], *, attempts: int = 1) -> str:
    """A few lines naming the failed rank, its error and where it was raised."""
    ordered = order_failures(failures)
    if not ordered:
        return "workers failed (no details recorded)"
    root = ordered[0]
    lines = [f"rank {root.rank} (local rank {root.local_rank}, pid {root.pid}) failed: {root.describe()}"]
    if root.location:
        lines.append(f"  at {root.location}")
    if root.error and root.exitcode != 0:
        lines.append(f"  exit code {root.exitcode}")
    others = ordered[1:]
    if others:
        lines.append("  then: " + "; ".join(f"rank {f.rank} {f.describe()}" for f in sorted(others, key=lambda f: f.rank)))
    if attempts > 1:
        lines.append(f"  gave up after {attempts} attempts (--max-restarts {attempts - 1})")
    return "\n".join(lines)


class WorkerFailedError(LaunchError):
    """A worker process failed; the message names the rank and its error.

    Attributes:
        failures: Every failed worker, root cause first.
        root: The root-cause failure.
        attempts: How many times the worker group was started.
        exit_code: What ``gpukit run`` exits with: the failed worker's exit code, 128 + N
            when it was killed by signal N, 1 when unknown.
        preempted: ``True`` when every failed worker exited with ``PREEMPTED_EXIT_CODE``
            (the workers themselves reported a clean preemption).
    """

    def __init__(self, failures: Iterable[WorkerFailure], *, attempts: int = 1) -> None:
        self.failures = order_failures(failures)
        self.attempts = attempts
        self.root: WorkerFailure | None = self.failures[0] if self.failures else None
        self.preempted = bool(self.failures) and all(
            f.exitcode == PREEMPTED_EXIT_CODE or (f.exitcode < 0 and -f.exitcode in _STOP_SIGNALS)
            for f in self.failures
        ) and self.failures[0].exitcode == PREEMPTED_EXIT_CODE  # not a SIGKILL found first
        root = self.root
        if self.preempted:
            self.exit_code = PREEMPTED_EXIT_CODE
        elif root is None:
            self.exit_code = 1
        elif root.exitcode > 0:
            self.exit_code = root.exitcode
        elif root.exitcode < 0:
            self.exit_code = 128 - root.exitcode
        else:
            self.exit_code = 1
        super().__init__(format_summary(self.failures, attempts=attempts))
