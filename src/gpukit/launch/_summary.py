"""A short failure summary: which rank failed first, with what error, where.

The elastic agent reports every worker that ended badly, including the healthy ones it
stopped itself after the real failure, and picks the "root cause" by a timestamp with
one-second resolution. Here the root cause is first a rank the launcher saw stall (a hang:
the others waited for it in a collective), then a worker that had already ended before the
launcher stopped the others (``before_stop``: e.g. SIGKILLed by the out-of-memory killer,
whose peers then fail with errors of their own in a collective); then the failure
that carries an error
(a traceback from the worker's error file, or a non-zero exit code) rather than a
SIGTERM/SIGKILL that the launcher sent, then the earliest, then the first the agent found
(it records the failed worker before it stops the others: a worker SIGKILLed from outside
comes before the workers the launcher then SIGTERMed, even within the same second), then
the lowest rank.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from gpukit.errors import LaunchError
from gpukit.worker import PREEMPTED_EXIT_CODE, EarlyError

__all__ = ["WorkerFailure", "WorkerFailedError", "order_failures", "format_summary", "with_early_errors",
           "HANG_EXIT_CODE"]

#: Exit code of ``gpukit run`` when a rank stalled (hang) and the collective timeout ended the
#: run -- 124, as coreutils' ``timeout``.
HANG_EXIT_CODE = 124

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
        before_stop: It had ended before the launcher began stopping the workers: it is
            what made the run fail, not a consequence of being stopped.
        stalled: What the launcher saw when this rank stopped making progress while other
            ranks waited for it in a collective (a hang), ``None`` if it did not stall;
            ``traceback`` then holds its stack at that moment unless it raised an error.
        early: What the worker was doing when it died before its Session was up (and before
            gpukit's code could record the error the usual way), ``None`` otherwise; ``error`` and
            ``traceback`` then hold what it left in the run's directory.
    """

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    error: str | None = None
    traceback: str | None = None
    timestamp: float = 0.0
    sequence: int = 0
    before_stop: bool = False
    stalled: str | None = None
    early: str | None = None

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
        if self.stalled:
            return self.stalled
        if self.signal_name == "SIGKILL" and self.before_stop:
            return "killed by SIGKILL (possibly the out-of-memory killer: see `dmesg` or `journalctl -k`)"
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
    """Root cause first: stalled > ended before the launcher stopped anyone > recorded error >
    exit code > other signal > stopped by the launcher.

    Within each kind: earliest timestamp, then the order the agent found them, then rank.
    """
    return sorted(failures, key=lambda f: (
        not f.stalled, not f.before_stop, _priority(f), f.timestamp, f.sequence, f.rank))


def format_summary(failures: Iterable[WorkerFailure], *, attempts: int = 1) -> str:
    """A few lines naming the failed rank, its error and where it was raised."""
    ordered = order_failures(failures)
    if not ordered:
        return "workers failed (no details recorded)"
    root = ordered[0]
    lines = [f"rank {root.rank} (local rank {root.local_rank}, pid {root.pid}) failed: {root.describe()}"]
    if root.early:
        lines.append(f"  before its Session was up, while {root.early}")
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


def with_early_errors(failures: Iterable[WorkerFailure], errors: dict[int, EarlyError]) -> list[WorkerFailure]:
    """``failures`` with the error each worker that recorded none left early (by pid) filled in.

    Args:
        failures: The failed workers.
        errors: Early errors by worker pid (``gpukit.worker.read_early_errors(run_dir)``).

    Returns:
        The same failures, in the same order.
    """
    filled = []
    for failure in failures:
        early = errors.get(failure.pid)
        if early is not None and not failure.error:
            failure = dataclasses.replace(failure, error=early.error, traceback=early.traceback, early=early.doing)
        filled.append(failure)
    return filled


class WorkerFailedError(LaunchError):
    """A worker process failed; the message names the rank and its error.

    Attributes:
        failures: Every failed worker, root cause first.
        root: The root-cause failure.
        attempts: How many times the worker group was started.
        exit_code: What ``gpukit run`` exits with: the root cause's exit code, 128 + N when
            it was killed by signal N (137 for a worker SIGKILLed -- the OOM killer -- before
            the launcher stopped the others, whatever they exited with),
            :data:`HANG_EXIT_CODE` (124) when a rank stalled, 1 when the root cause raised an
            exception (even if the launcher's stop then caught it while exiting) or is unknown.
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
        if root is not None and root.stalled and not root.error:  # hung until the timeout
            self.exit_code = HANG_EXIT_CODE
        elif self.preempted:
            self.exit_code = PREEMPTED_EXIT_CODE
        elif root is None:
            self.exit_code = 1
        elif root.exitcode > 0:
            self.exit_code = root.exitcode
        elif root.error and -root.exitcode in _STOP_SIGNALS:
            self.exit_code = 1  # it raised, and was stopped while exiting: as if it had exited 1
        elif root.exitcode < 0:
            self.exit_code = 128 - root.exitcode
        else:
            self.exit_code = 1
        super().__init__(format_summary(self.failures, attempts=attempts))
