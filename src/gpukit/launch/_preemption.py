"""Preemption: SIGTERM in a worker becomes a "stop requested" flag instead of death.

A cluster that preempts a job sends SIGTERM and, a grace period later, SIGKILL. With the
handler installed, the first SIGTERM (or SIGINT) only sets a flag; the training loop sees
it at its next step boundary (a Session all-reduces it so every rank stops at the same
step), saves a checkpoint and exits 0. ``gpukit run`` then exits with
:data:`PREEMPTED_EXIT_CODE`. A second terminating signal (SIGTERM, SIGINT) falls through to
the previous handler, so an impatient user can still stop a worker that never checks the flag.
``gpukit run`` exits 75 also when only one worker was signalled: the Session leaves a
marker in the run's directory (``GPUKIT_RUN_DIR``) when its ranks agreed to stop, and the
launcher reads it. DataLoader workers ignore SIGTERM/SIGINT (``gpukit.data``), so a stop
sent to whole process groups -- as schedulers and terminals do -- reaches the training
process, not its loaders' deaths first.

A scheduler that warns before it stops a job (SLURM's ``--signal=B:USR2@90``) sends the
preemption signal -- :func:`preempt_signal`: SIGUSR2 by default, ``GPUKIT_PREEMPT_SIGNAL``
to choose USR1 or TERM -- which sets the same flag and never escalates (it may come twice,
and the launcher's SIGTERM follows it); ``gpukit.launch._requeue`` then requeues the job.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
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
    "PREEMPT_SIGNAL_ENV",
    "DEFAULT_PREEMPT_SIGNAL",
    "PREEMPT_SIGNAL_CHOICES",
    "parse_preempt_signal",
    "preempt_signal",
    "stop_signal_name",
    "session_stop_signals",
    "mark_stop_agreed",
    "stop_markers",
    "RUN_DIR_ENV",
]

#: Directory ``gpukit run`` creates for one run; workers leave stop markers (and heartbeats)
#: there for the launcher to read.
RUN_DIR_ENV = "GPUKIT_RUN_DIR"
_MARKER_PREFIX = "stopped-rank"

#: Exit code of ``gpukit run`` (and what a worker may exit with) when a run stopped
#: because it was asked to -- preempted -- and its workers stopped cleanly. It is
#: ``EX_TEMPFAIL`` from sysexits.h: "temporary failure, try again", so a scheduler can
#: requeue the job, which then resumes from its last checkpoint.
PREEMPTED_EXIT_CODE = 75

_Handler = Union[Callable[[int, Union[FrameType, None]], object], int, None]

_stop = threading.Event()
_previous: dict[int, _Handler] = {}
_received: list[str] = []  # name of the signal that set the flag
_terminations: set[int] = set()  # terminating signals received; another one escalates
_WARNING_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # A scheduler's warning (SIGUSR1/2) may come more than once, and the launcher's SIGTERM
    # follows it: neither means "stop now". Only a second terminating signal does.
    warning = signum in _WARNING_SIGNALS
    escalate = not warning and bool(_terminations)
    if not warning:
        _terminations.add(signum)
    if not escalate:
        if not _stop.is_set():
            _stop.set()
            _received[:] = [signal.Signals(signum).name]
            # os.write, not print: a signal handler may run in the middle of another print.
            name = signal.Signals(signum).name
            rank = os.environ.get("RANK")
            who = f"rank {rank}: " if rank else ""  # no rank outside a launched job
            os.write(2, f"gpukit: {who}{name} received, stopping at the next step boundary\n".encode())
            emit("preemption", signal=name)
        return
    # Second terminating signal: behave as if we had never been installed.
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
    _received.clear()
    _terminations.clear()


def stop_signal_name() -> str | None:
    """The signal that set the stop flag (``"SIGUSR2"``), ``None`` if none did."""
    return _received[0] if _received else None


#: The signal that means "preempted soon: save and requeue" -- SLURM's ``--signal``. Set by
#: ``gpukit run --signal`` for its workers; set it yourself for ``srun python train.py``.
PREEMPT_SIGNAL_ENV = "GPUKIT_PREEMPT_SIGNAL"
#: SIGUSR2 by default: NCCL and some MPI stacks use SIGUSR1 themselves (submitit's choice too).
DEFAULT_PREEMPT_SIGNAL = "USR2"
PREEMPT_SIGNAL_CHOICES = ("USR2", "USR1", "TERM")


def parse_preempt_signal(text: str, source: str = "--signal") -> signal.Signals:
    """``"USR2"``/``"SIGUSR2"``/``"usr1"``/``"TERM"`` -> the signal.

    Raises:
        ConfigurationError: any other name.
    """
    from gpukit.errors import ConfigurationError

    name = str(text).strip().upper()
    name = name[3:] if name.startswith("SIG") else name
    if name not in PREEMPT_SIGNAL_CHOICES:
        raise ConfigurationError(
            f"{source} {text!r} is not a preemption signal gpukit handles; use one of "
            f"{', '.join(PREEMPT_SIGNAL_CHOICES)} (the signal named in `#SBATCH --signal=B:USR2@90`)."
        )
    return signal.Signals[f"SIG{name}"]


def preempt_signal(environ: Mapping[str, str] | None = None) -> signal.Signals:
    """The preemption signal of this process: ``GPUKIT_PREEMPT_SIGNAL``, else SIGUSR2.

    Raises:
        ConfigurationError: the variable names a signal other than USR2, USR1 or TERM.
    """
    env = os.environ if environ is None else environ
    value = env.get(PREEMPT_SIGNAL_ENV)
    return parse_preempt_signal(value, PREEMPT_SIGNAL_ENV) if value else signal.Signals[f"SIG{DEFAULT_PREEMPT_SIGNAL}"]


def session_stop_signals() -> tuple[int, ...]:
    """The signals a Session turns into a stop request in this process.

    SIGTERM and SIGINT under a launcher (``gpukit run`` sets ``GPUKIT_LAUNCHER_PID``, torchrun
    ``TORCHELASTIC_RUN_ID``; torchrun forwards Ctrl-C as SIGINT); SIGTERM alone under plain
    ``python``, where Ctrl-C should still interrupt at once. Plus the preemption signal
    (:func:`preempt_signal`) under ``gpukit run``, in a SLURM job (SLURM may send it to every
    process of the job), or when ``GPUKIT_PREEMPT_SIGNAL`` is set; elsewhere SIGUSR1/2 keep
    whatever meaning the program gives them.
    """
    from gpukit.cluster import in_slurm_job
    from gpukit.launch._orphans import LAUNCHER_PID_ENV

    launched = bool(os.environ.get(LAUNCHER_PID_ENV) or os.environ.get("TORCHELASTIC_RUN_ID"))
    signals = [signal.SIGTERM, signal.SIGINT] if launched else [signal.SIGTERM]
    if os.environ.get(LAUNCHER_PID_ENV) or os.environ.get(PREEMPT_SIGNAL_ENV) or in_slurm_job(os.environ):
        warning = preempt_signal()
        if warning not in signals:
            signals.append(warning)
    return tuple(signals)


def mark_stop_agreed(rank: int) -> None:
    """Tell the launcher (through ``GPUKIT_RUN_DIR``) that this rank stopped because asked to.

    ``gpukit run`` then exits with :data:`PREEMPTED_EXIT_CODE` even when the workers exit 0
    and the launcher itself received no signal (a stop sent to one worker). No-op outside
    ``gpukit run``.
    """
    directory = os.environ.get(RUN_DIR_ENV)
    if not directory:
        return
    try:
        (Path(directory) / f"{_MARKER_PREFIX}{rank}").write_text(stop_signal_name() or "SIGTERM")
    except OSError:  # the launcher's directory is gone: it is not waiting for the answer
        pass


def stop_markers(directory: str | os.PathLike[str]) -> dict[int, str]:
    """Ranks that left a stop marker in ``directory``, with the signal each received."""
    found: dict[int, str] = {}
    for path in Path(directory).glob(f"{_MARKER_PREFIX}*"):
        suffix = path.name[len(_MARKER_PREFIX):]
        if suffix.isdigit():
            try:
                found[int(suffix)] = path.read_text().strip() or "SIGTERM"
            except OSError:
                continue
    return found
