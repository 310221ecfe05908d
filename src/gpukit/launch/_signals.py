"""Launcher-side signals: Ctrl-C/SIGTERM stop the run gracefully, a second one stops it now.

The elastic agent does the stopping itself (SIGTERM to every worker's process group,
``--grace`` seconds, then SIGKILL); this module decides *when*: it turns a stop signal
into :class:`StopSignal` in the launcher's main thread, keeps a second signal from
aborting a shutdown half way (it SIGKILLs the workers at once instead), and puts the
caller's own handlers back afterwards -- ``launch_function`` runs inside user programs.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType

from gpukit.errors import LaunchError
from gpukit.worker import PREEMPTED_EXIT_CODE

__all__ = [
    "STOP_SIGNALS",
    "StopSignal",
    "raise_if_held",
    "held_signals_raise",
    "RunInterruptedError",
    "launcher_signals",
    "escalate_on_signal",
    "kill_now",
    "interrupted_exit_code",
    "worker_stop_signal",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


#: the stop signal the launcher received last (the agent forwards SIGINT as SIGINT, anything else as SIGTERM)
_last_stop: list[int] = []


class StopSignal(Exception):
    """Raised in the launcher's main thread when it receives a stop signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        _last_stop[:] = [signum]  # how the workers are told (worker_stop_signal)
        super().__init__(f"launcher received {signal.Signals(signum).name}")


class RunInterruptedError(LaunchError):
    """The launcher was told to stop (Ctrl-C, SIGTERM, ...) and stopped its workers.

    Attributes:
        signal_name: The signal the launcher received, e.g. ``"SIGTERM"``.
        preempted: ``True`` when every worker exited by itself (code 0 or
            ``PREEMPTED_EXIT_CODE``) within the grace period -- a clean preemption.
        exit_code: ``PREEMPTED_EXIT_CODE`` (75) when preempted, else 128 + signal number.
    """

    def __init__(self, signum: int, *, preempted: bool, grace_s: float, detail: str | None = None) -> None:
        self.signal_name = signal.Signals(signum).name
        self.preempted = preempted
        self.exit_code = interrupted_exit_code(signum, preempted=preempted)
        #: Signal names the launchers of the run's other nodes received (node 0 of a multi-node
        #: run collects them before it requeues; see ``gpukit.launch._stop_report``).
        self.other_signals: set[str] = set()
        if preempted and signum == signal.SIGINT:  # Ctrl-C: the user's interrupt, not a scheduler's stop
            msg = (
                f"run interrupted (SIGINT, Ctrl-C): {detail or 'every worker stopped cleanly'} "
                f"(exit code {self.exit_code})"
            )
        elif preempted:
            msg = (
                f"run preempted: {self.signal_name} received; "
                f"{detail or 'every worker stopped cleanly'} (exit code {self.exit_code})"
            )
        else:
            msg = (
                f"run stopped by {self.signal_name}: workers got SIGTERM and, after {grace_s:g} s, "
                f"SIGKILL if still running (exit code {self.exit_code})"
            )
        super().__init__(msg)


def interrupted_exit_code(signum: int, *, preempted: bool) -> int:
    """``PREEMPTED_EXIT_CODE`` for a clean stop, else the shell's 128 + signal number. SIGINT (Ctrl-C)
    is an interrupt, never a preemption: 130 however cleanly the workers stopped (75 would ask a
    scheduler to requeue a run its user meant to end)."""
    return PREEMPTED_EXIT_CODE if preempted and signum != signal.SIGINT else 128 + int(signum)



def worker_stop_signal() -> int:
    """The signal the workers get when the launcher stops them: SIGINT after a Ctrl-C (they say
    "interrupted"), SIGTERM otherwise."""
    return signal.SIGINT if _last_stop and _last_stop[-1] == signal.SIGINT else signal.SIGTERM


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopSignal(signum)


@contextmanager
def _stop_signals_handled_by(
    handler: Callable[[int, FrameType | None], None],
    preempt: int | None = None,
    preempt_handler: Callable[[int, FrameType | None], None] | None = None,
) -> Iterator[None]:
    """Install ``handler`` for the stop signals inside the block, then restore the old ones.

    ``preempt`` (the scheduler's warning signal, e.g. SIGUSR2) gets ``preempt_handler``, or
    ``handler`` when none is given. Off the main thread Python cannot install handlers, so
    this does nothing there.
    """
    if not _in_main_thread():
        yield
        return
    handlers: dict[int, Callable[[int, FrameType | None], None]] = {sig: handler for sig in STOP_SIGNALS}
    if preempt is not None and preempt not in handlers:
        handlers[preempt] = preempt_handler or handler
    saved = {sig: signal.getsignal(sig) for sig in handlers}
    try:
        for sig, function in handlers.items():
            signal.signal(sig, function)
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


@contextmanager
def launcher_signals(preempt: int | None = None) -> Iterator[None]:
    """Stop signals (and the preemption signal ``preempt``, e.g. SIGUSR2) raise
    :class:`StopSignal` inside the block; old handlers come back after.

    Off the main thread Python cannot install handlers, so this does nothing there.
    """
    # Restoring also undoes the handlers the elastic agent installs at every worker start.
    from gpukit._util import startup_signals

    with _stop_signals_handled_by(_raise_stop, preempt):
        raise_if_held()  # from here on a signal raises: one held while starting, too
        startup_signals.mark_started()
        yield


def raise_if_held() -> None:
    """Raise :class:`StopSignal` for a stop signal ``gpukit run`` held while it was starting
    (``gpukit._util.startup_signals``: the CLI entry point records SIGUSR1/SIGUSR2/SIGTERM from
    its first line). Called where stopping is safe -- never in the middle of an import, where an
    exception raised by a signal handler leaves half-imported modules behind (numpy: "cannot load
    module more than once") or is swallowed by importlib (the launcher then never stops)."""
    from gpukit._util import startup_signals

    early = startup_signals.received()
    if early is not None:
        startup_signals.forget()
        raise StopSignal(early)


@contextmanager
def held_signals_raise() -> Iterator[None]:
    """Inside the block (a wait with nothing being imported: ``--wait`` for GPUs) the signals the
    CLI holds while starting raise :class:`StopSignal` at once instead of waiting to be acted on."""
    from gpukit._util.startup_signals import HELD_SIGNALS

    if not _in_main_thread():
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in HELD_SIGNALS}
    try:
        for signum in HELD_SIGNALS:
            signal.signal(signum, _raise_stop)
        raise_if_held()
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


@contextmanager
def escalate_on_signal(on_signal: Callable[[], None], preempt: int | None = None) -> Iterator[None]:
    """During a graceful shutdown, a further stop signal calls ``on_signal`` (kill now).

    Without this a second Ctrl-C would raise in the middle of the agent's shutdown and
    leave workers without their SIGKILL. A repeated preemption signal (``preempt``: the
    scheduler may send its warning to every process of the job) changes nothing.
    """
    def handler(signum: int, frame: FrameType | None) -> None:
        os.write(2, f"gpukit: {signal.Signals(signum).name} again: killing workers now\n".encode())
        on_signal()

    with _stop_signals_handled_by(handler, preempt, _ignore):
        yield


def kill_now(pids: Iterable[int]) -> None:
    """SIGKILL each worker's process group (workers lead their own), or the pid alone."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
            continue
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
