"""What every worker runs first (``python -m gpukit.worker._bootstrap script.py args...``
for scripts, :func:`run_function` for functions).

It makes the worker die with its launcher (see ``_orphans``), then runs the user's script
(or ``-m module``) exactly as ``python script.py`` would -- same ``sys.argv``, same
``sys.path[0]``, ``__name__ == "__main__"`` -- so scripts written for torchrun run
unchanged. An uncaught exception is written to the worker's error file
(``TORCHELASTIC_ERROR_FILE``, torch elastic's own format) so the launcher's summary can
name the rank and its error. :func:`run_function` is the same for function workers.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import re
import runpy
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from gpukit._util.envvars import STOP_EXIT_ENV
from gpukit._util.units import whole_number
from gpukit.worker._env import worker_env
from gpukit.worker._exit_state import leaves_a_group_at_exit, note_failure
from gpukit.worker._orphans import die_with_launcher
from gpukit.worker._stop import (
    PREEMPTED_EXIT_CODE,
    finish_agreed_stop,
    flush_open_files,
    flush_stdio,
    install_startup_stop,
    mark_completed,
    stop_requested,
    stop_signal_name,
)
from gpukit.worker._stop_signals import preempt_signal
from gpukit.worker._warnings import show_warnings_once_per_run

__all__ = ["main", "run_function", "record_exception"]

_USAGE = "usage: python -m gpukit.worker._bootstrap (SCRIPT | -m MODULE) [ARGS...]"


def record_exception(exc: BaseException) -> None:
    """Write ``exc`` (being handled) to ``TORCHELASTIC_ERROR_FILE`` in elastic's format."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        # Imported only on failure: a worker that succeeds never pays for it.
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - reporting must never mask the real error
        pass


_IMPORTS_GPUKIT = re.compile(rb"^(import[ \t]+gpukit|from[ \t]+gpukit[. \t])", re.MULTILINE)  # top level
_SCAN_LIMIT_BYTES = 4 << 20


def _imports_gpukit(argv: Sequence[str]) -> bool:
    """Whether the script (or ``-m`` module) imports gpukit: it will make a Session, so a stop
    before that is a clean one. A script without gpukit keeps the signals' default action: the
    launcher cannot tell what stopping it would lose."""
    try:
        if argv[0] == "-m":
            spec = importlib.util.find_spec(argv[1]) if len(argv) > 1 else None
            path = spec.origin if spec is not None else None
        else:
            path = argv[0]
        if not path or not os.path.isfile(path):
            return False
        with open(path, "rb") as file:
            return bool(_IMPORTS_GPUKIT.search(file.read(_SCAN_LIMIT_BYTES)))
    except (OSError, ImportError, ValueError):
        return False


def _run_target(argv: Sequence[str]) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(_USAGE)
        module, args = argv[1], list(argv[2:])
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()  # as `python -m` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], list(argv[1:])
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` does
        runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run a script or module as a supervised worker; exits with its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit(_USAGE)
    die_with_launcher()
    show_warnings_once_per_run(worker_env().run_dir)  # a warning every rank gives: printed once
    if _imports_gpukit(argv):  # a stop before its Session exists ends it at once, as a clean stop
        install_startup_stop((signal.SIGTERM, signal.SIGINT, preempt_signal()))
    try:
        _run_target(argv)
    except SystemExit as exc:
        if exc.code not in (None, 0, PREEMPTED_EXIT_CODE):
            _note_failure()
        elif _ended_by_itself(exc.code or 0) or _leaves_a_group():
            _leave_after_stop(exc.code or 0)
        raise
    except Exception as exc:
        _note_failure()
        record_exception(exc)
        if not _peers_left_a_stopped_run(exc):
            _print_user_traceback(exc)
        raise SystemExit(1) from None
    except BaseException as exc:  # KeyboardInterrupt & co: keep Python's own exit behaviour
        record_exception(exc)
        raise
    if _ended_by_itself(0) or _leaves_a_group():
        _leave_after_stop(0)
    raise SystemExit(0)


def _ended_by_itself(code: int) -> bool:
    """The script ended (exit 0/75): finish its agreed stop (``True``), or, with no stop asked
    for and exit 0, mark its training over (``completed``: a warning now requeues nothing)."""
    if finish_agreed_stop():
        return True
    if code == 0:
        mark_completed()
    return False


def _leaves_a_group() -> bool:
    # A script whose Session created a process group ended normally: after the exit hooks
    # (the Session's leaves the group) it ends without the interpreter's teardown, where
    # torch's gloo destructors aborted about 1 finished 2-process run in 30 under load
    # ("terminate called without an active exception", exit 134: a success reported as failure).
    # A script of several processes that drives torch.distributed itself (no Session) meets the
    # same destructors even after its own destroy_process_group() -- seen in a full CI run:
    # a plain DDP script's rank 1 aborted so after it had finished.
    if leaves_a_group_at_exit():
        return True
    return whole_number(os.environ.get("WORLD_SIZE", "")) not in (None, 0, 1)


def _leave_after_stop(code: int) -> None:
    """The stop is finished and marked: leave fast. Returns only in ``python`` mode.

    How a worker whose stop is finished, or whose script ended after its Session created a
    process group, leaves (``GPUKIT_STOP_EXIT``; bench/preemption.py compares them):
    ``hooks`` (default) runs the exit hooks -- the Session's leaves the process group --
    then ``os._exit``; ``python`` leaves as Python does (hooks, then the interpreter's teardown,
    where gloo's and the loaders' destructors ran for 4-12 s under load); ``now`` skips the hooks.
    """
    mode = os.environ.get(STOP_EXIT_ENV, "hooks")
    if mode == "python":
        return
    if mode != "now":
        try:
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001 - the stop is complete; leaving matters more
            pass
    flush_open_files()  # what the interpreter's teardown would have written out
    flush_stdio()
    os._exit(code if isinstance(code, int) else 0)


def _note_failure() -> None:
    # this rank is failing: a Session's exit hook must not wait at a barrier for its peers
    note_failure()


_DISTRIBUTED_DIR = os.sep + os.path.join("torch", "distributed") + os.sep


def _peers_left_a_stopped_run(exc: BaseException) -> bool:
    """A collective that failed because a stop (SIGTERM, SIGINT: ``scancel``, Ctrl-C) ended the peers
    first: one line instead of the traceback -- gloo's "Connection reset by peer" is the stop's echo,
    not an error of this rank's (issue 41.11). Told by the stop and where it was raised (inside
    torch.distributed), not by the message's words."""
    if not stop_requested() or stop_signal_name() not in ("SIGTERM", "SIGINT"):
        return False
    if not any(_raised_in_torch_distributed(e) for e in _chain(exc)):
        return False
    rank = os.environ.get("RANK")
    first = (str(exc).splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    sys.stderr.write(f"gpukit: {f'rank {rank}: ' if rank else ''}stopped by {stop_signal_name()}; a collective "
                     f"ended as the other ranks stopped ({type(exc).__name__}: {first})\n")
    sys.stderr.flush()
    return True


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from or during (a checkpoint's collective wraps torch's error)."""
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen) and len(seen) < 16:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and _DISTRIBUTED_DIR in last


def _print_user_traceback(exc: BaseException) -> None:
    # What `python script.py` would print: without the frames of this bootstrap and runpy.
    tb = exc.__traceback__
    own = (os.path.dirname(os.path.abspath(__file__)), "<frozen runpy>", runpy.__file__ or "runpy")
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(own):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
    sys.stderr.flush()


def _own_process_group() -> None:
    # Like script workers (started in a new session by the agent): the terminal's Ctrl-C
    # reaches only the launcher, which then stops every worker the same graceful way.
    try:
        os.setpgid(0, 0)
    except OSError:
        pass


def run_function(fn: Callable[..., Any], *args: Any) -> Any:
    """Entry point of a function worker: supervise, then return ``fn(*args)``."""
    die_with_launcher()
    _own_process_group()
    return fn(*args)
