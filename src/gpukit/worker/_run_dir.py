"""The run's directory (``GPUKIT_RUN_DIR``): the files workers leave there for their launcher, and
their readers -- every file name of the directory is here.

``gpukit run`` creates one directory per run. In it, each worker writes:

* ``stopped-rank{R}`` -- its stop marker (atomically: write, then rename), holding the signal
  that stopped it and how far its stop got:

  - ``agreed`` -- its Session's ranks agreed to stop (``session.should_stop`` was true);
  - ``finished`` -- then the script ended by itself (exit 0 or 75): it saved what it wanted to;
  - ``before-start`` -- the signal came before the worker's Session existed: nothing to save;
  - ``completed`` -- no stop: the script ended by itself before any was asked for (its training
    is over; a warning that reaches the launcher after every rank completed requeues nothing).

  The launcher counts a worker whose marker is ``finished``, ``before-start`` or ``completed`` as
  a clean stop whatever happens to it afterwards -- a slow teardown SIGKILLed at ``--grace``
  included.
* ``hb-rank{R}.json`` -- its heartbeat (see :mod:`gpukit.worker._heartbeat`), read by the
  launcher's stall monitor;
* ``stack-rank{R}.txt`` -- every thread's stack, dumped there on SIGQUIT.
* ``early-error-pid{PID}.json`` -- the error that ended a worker before any of gpukit's code could
  record it elsewhere (a spawned function worker importing the launcher's script again: see
  :mod:`gpukit.worker._spawn_main`), by the worker's pid, for the launcher's summary;
* ``saved-rank{R}`` -- the step of the last checkpoint it saved completely (every rank's files
  committed): an elastic launcher lets returning nodes join at a checkpoint (no steps redone);
* ``warned-<hash>`` -- an empty claim on a warning's text, so that one rank prints a warning every
  rank gives (see :mod:`gpukit.worker._warnings`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AGREED", "FINISHED", "BEFORE_START", "COMPLETED", "StopMarker", "write_marker", "read_markers",
    "stop_markers", "clear_markers",
    "heartbeat_path", "stack_path", "read_heartbeats", "EarlyError", "write_early_error", "read_early_errors",
    "note_checkpoint", "checkpoints_seen",
]

AGREED = "agreed"
FINISHED = "finished"
BEFORE_START = "before-start"
#: not a stop: the script ended by itself, no stop asked for -- its training is over
COMPLETED = "completed"
_STATES = (AGREED, FINISHED, BEFORE_START, COMPLETED)
_PREFIX = "stopped-rank"
_HEARTBEAT_PREFIX = "hb-rank"
_STACK_PREFIX = "stack-rank"
_EARLY_PREFIX = "early-error-pid"
_EARLY_MAX_BYTES = 16 << 10  # a traceback's last lines are what matters; bound what is read back
_EARLY_MAX_FILES = 1024


@dataclass(frozen=True)
class StopMarker:
    """One rank's marker: the signal that stopped it and the stop's ``state``."""

    signal_name: str
    state: str

    @property
    def done(self) -> bool:
        """Whether this rank's stop is complete (nothing more to save)."""
        return self.state in (FINISHED, BEFORE_START, COMPLETED)


def write_marker(directory: str | os.PathLike[str] | None, rank: int, signal_name: str, state: str) -> None:
    """Write rank ``rank``'s marker in ``directory`` (no-op when ``None`` or gone). Async-signal
    tolerant: plain os calls only, so a signal handler may call it."""
    if not directory:
        return
    final = os.path.join(os.fspath(directory), f"{_PREFIX}{rank}")
    temporary = f"{final}.{os.getpid()}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{signal_name} {state}\n".encode())
        finally:
            os.close(fd)
        os.replace(temporary, final)
    except OSError:  # the launcher's directory is gone: it is not waiting for the answer
        pass


def read_markers(directory: str | os.PathLike[str]) -> dict[int, StopMarker]:
    """Every rank's marker in ``directory``, by global rank."""
    found: dict[int, StopMarker] = {}
    for path in Path(directory).glob(f"{_PREFIX}*"):
        suffix = path.name[len(_PREFIX):]
        if not suffix.isdigit():
            continue
        try:
            words = path.read_text().split()
        except OSError:
            continue
        name = words[0] if words else "SIGTERM"
        state = words[1] if len(words) > 1 and words[1] in _STATES else AGREED
        found[int(suffix)] = StopMarker(name, state)
    return found


def stop_markers(directory: str | os.PathLike[str]) -> dict[int, str]:
    """Ranks that left a stop marker in ``directory``, with the signal each received (a rank whose
    script completed without a stop is not one)."""
    return {rank: marker.signal_name for rank, marker in read_markers(directory).items()
            if marker.state != COMPLETED}


def clear_markers(directory: str | os.PathLike[str]) -> None:
    """Remove every rank's marker, heartbeat and stack dump from ``directory``: a new worker group starts
    (the launcher restarted the group -- a failure, a node lost or back), and what the group it replaced
    left is over. Left there, a rank that the new group numbers differently would keep its old
    ``finished`` (turning the run's clean end into a preemption, exit 75) and its old heartbeat (the
    stall monitor would name a dead rank, and signal its pid, which another process may have by now).
    What the workers saved (``saved-rank``) and early errors stay."""
    for pattern in (f"{_PREFIX}*", f"{_HEARTBEAT_PREFIX}*.json", f"{_STACK_PREFIX}*.txt"):
        for path in Path(directory).glob(pattern):
            try:
                path.unlink()
            except OSError:  # gone already
                pass


_SAVED_PREFIX = "saved-rank"


def note_checkpoint(step: int, rank: int, directory: str | os.PathLike[str] | None = None) -> None:
    """Record that rank ``rank`` saved the checkpoint of ``step`` completely, in ``directory`` (by default
    the run's, ``GPUKIT_RUN_DIR``; nothing without one)."""
    if directory is None:
        from gpukit.worker._env import WorkerEnv

        directory = WorkerEnv.from_env().run_dir
    if not directory:
        return
    final = os.path.join(os.fspath(directory), f"{_SAVED_PREFIX}{rank}")
    temporary = f"{final}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as out:
            out.write(f"{int(step)}\n")
        os.replace(temporary, final)
    except OSError:  # the launcher's directory is gone: nobody is waiting for it
        pass


def checkpoints_seen(directory: str | os.PathLike[str]) -> tuple[int, ...]:
    """A value that changes whenever a worker of ``directory`` notes a checkpoint (their files' times)."""
    stamps = []
    for path in Path(directory).glob(f"{_SAVED_PREFIX}*"):
        try:
            stamps.append(path.stat().st_mtime_ns)
        except OSError:
            continue
    return tuple(sorted(stamps))


def heartbeat_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its heartbeat."""
    return Path(directory) / f"{_HEARTBEAT_PREFIX}{rank}.json"


def stack_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` dumps every thread's stack on SIGQUIT."""
    return Path(directory) / f"{_STACK_PREFIX}{rank}.txt"


def read_heartbeats(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The latest heartbeat of every rank in ``directory``, by rank (unreadable ones left out)."""
    beats = {}
    for path in Path(directory).glob(f"{_HEARTBEAT_PREFIX}*.json"):
        try:
            record = json.loads(path.read_text())
            beats[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


@dataclass(frozen=True)
class EarlyError:
    """What ended a worker before its Session was up.

    Attributes:
        doing: What the worker was doing (``"importing /x/train.py again in the spawned worker"``).
        traceback: Its traceback as Python prints it, the last lines kept.
    """

    doing: str
    traceback: str

    @property
    def error(self) -> str:
        """The exception line (``"ModuleNotFoundError: No module named 'x'"``): the traceback's last line."""
        lines = [line for line in self.traceback.splitlines() if line.strip()]
        return lines[-1].strip() if lines else "an error with no message"


def write_early_error(directory: str | os.PathLike[str] | None, doing: str, traceback_text: str) -> None:
    """Leave this process's early error in ``directory`` for the launcher (no-op when ``None`` or gone)."""
    if not directory:
        return
    record = json.dumps({"doing": doing, "traceback": traceback_text[-_EARLY_MAX_BYTES // 2:]})
    path = os.path.join(os.fspath(directory), f"{_EARLY_PREFIX}{os.getpid()}.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, record.encode())
        finally:
            os.close(fd)
    except OSError:  # the launcher's directory is gone: nobody is waiting for it
        pass


def read_early_errors(directory: str | os.PathLike[str]) -> dict[int, EarlyError]:
    """Every early error left in ``directory``, by the pid of the worker that left it."""
    found: dict[int, EarlyError] = {}
    for path in sorted(Path(directory).glob(f"{_EARLY_PREFIX}*.json"))[:_EARLY_MAX_FILES]:
        pid = path.name[len(_EARLY_PREFIX):-len(".json")]
        if not pid.isdigit():
            continue
        try:
            with open(path, "rb") as file:
                record = json.loads(file.read(_EARLY_MAX_BYTES))
            found[int(pid)] = EarlyError(str(record["doing"]), str(record["traceback"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found
