"""A stalled loader ends in a clear error naming the cause and the fix, never in a hang.

Three ways a loader stops producing batches, each told apart here:

* a worker is killed -- by the kernel's out-of-memory killer (SIGKILL) or by a bus error
  (SIGBUS) when ``/dev/shm``, which carries batches from workers to the training process, is
  full (64 MB by default in Docker);
* the dataset hangs (a read on a network filesystem, a lock, a deadlock after ``fork``).

Every wait for a batch has a data timeout (``data_timeout_s``, default
:data:`DEFAULT_DATA_TIMEOUT_S`, or ``GPUKIT_DATA_TIMEOUT_S``): with workers it is the
DataLoader's own ``timeout``; without workers (the dataset runs in the training process) a
watchdog thread that, once a wait passes the timeout, sends SIGALRM to the training thread,
whose handler raises inside the dataset's code -- where this process may take SIGALRM (the
main thread, no other SIGALRM handler or timer). Where it may not, the watchdog prints where
the dataset is stuck (it cannot interrupt the training thread). A wait costs two clock reads,
not a timer system call per batch (arming and disarming ``setitimer`` around every batch was
a quarter of the loader's per-batch cost).
Before workers fill ``/dev/shm``, a warning says so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from gpukit._util.envvars import DATA_TIMEOUT_ENV
from gpukit._util.process import signal_label
from gpukit._util.units import format_bytes
from gpukit._util.warnings import is_internal, warn_at_user_code
from gpukit.errors import ConfigurationError, DataStallError

__all__ = ["DEFAULT_DATA_TIMEOUT_S", "SharedMemoryWarning", "StallGuard", "resolve_data_timeout"]

#: long enough for any sane batch (and for spawned workers to import the script), but finite
DEFAULT_DATA_TIMEOUT_S = 600.0
_ENV = DATA_TIMEOUT_ENV
_SHM = "/dev/shm"

_SHM_FIX = (
    "Give the container more shared memory: `docker run --shm-size=8g` (or `--ipc=host`); on "
    "Kubernetes mount an emptyDir with `medium: Memory` at /dev/shm. Or keep fewer batches in "
    "flight: fewer workers, prefetch_factor=1, smaller batches"
)


class SharedMemoryWarning(UserWarning):
    """The loader's workers are about to fill ``/dev/shm`` (they then die with a bus error)."""


class _DataTimeout(BaseException):
    """Raised by the SIGALRM handler inside the dataset's code (BaseException: a broad
    ``except Exception`` in a dataset must not swallow it)."""


def resolve_data_timeout(value: float | None) -> float:
    """The data timeout in seconds: ``value``, else ``GPUKIT_DATA_TIMEOUT_S``, else the default.

    Raises:
        ConfigurationError: not a positive number.
    """
    source = "data_timeout_s"
    if value is None:
        env = os.environ.get(_ENV)
        if not env:
            return DEFAULT_DATA_TIMEOUT_S
        source = _ENV
        try:
            value = float(env)
        except ValueError:
            value = env  # type: ignore[assignment]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(
            f"{source}={value!r}; use a number of seconds > 0 (default {DEFAULT_DATA_TIMEOUT_S:g}). "
            "It bounds the wait for one batch, so make it longer than your slowest batch."
        )
    return float(value)


class StallGuard:
    """Draws batches for a :class:`~gpukit.data.DeviceLoader` with the stall checks.

    Args:
        loader: the torch DataLoader being iterated.
        timeout_s: the data timeout.
    """

    def __init__(self, loader: Any, timeout_s: float) -> None:
        self.loader = loader
        # with workers the DataLoader's own timeout is what applies (the user's, if given)
        own = getattr(loader, "timeout", 0) if getattr(loader, "num_workers", 0) else 0
        self.timeout_s = float(own) if own else timeout_s
        self._alarm = False
        self._waiting = False
        self._previous: Any = None
        self._shm_checked = False
        self._watched = False
        self.kicked = False  # the watchdog sent SIGALRM for a wait past the timeout
        self.watched_ident: int | None = None
        self.warned_since: float | None = None
        self.batches: Iterator[Any] | None = None  # the pass under way
        self.waiting_since: float | None = None  # fallback without SIGALRM: the watchdog reads it

    # -- per pass ---------------------------------------------------------------------------
    def begin(self, batches: Iterator[Any]) -> None:
        """Start a pass over ``batches`` (the DataLoader's iterator): SIGALRM without workers, where the process allows it;
        with workers, torch's SIGCHLD handler made to raise :class:`DataStallError`."""
        self._alarm = False
        self.batches = batches
        if self.loader.num_workers:
            _GUARDS.add(self)
            _translate_sigchld()
            return
        previous = signal.getsignal(signal.SIGALRM) if hasattr(signal, "setitimer") else None
        self.watched_ident = threading.get_ident()  # the thread the watchdog would interrupt
        if not self._watched:
            self._watched = True
            _watch(self)
        if (
            threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "pthread_kill")  # Windows
            or signal.getitimer(signal.ITIMER_REAL)[0]  # someone else's timer is running
            or previous not in (signal.SIG_DFL, None)  # the program handles SIGALRM itself
        ):
            return
        self._previous = previous
        signal.signal(signal.SIGALRM, _Handler(self, previous))
        self._alarm = True

    def end(self) -> None:
        """End the pass; a pass that ended with a dead worker (an error we did not see) stops
        the others, so torch's SIGCHLD handler does not raise again later, anywhere."""
        _GUARDS.discard(self)
        batches, self.batches = self.batches, None
        workers = getattr(batches, "_workers", ())
        if any(getattr(w, "exitcode", None) not in (None, 0) for w in workers):
            self.abort(batches)
        if self._alarm:
            if isinstance(signal.getsignal(signal.SIGALRM), _Handler):
                signal.signal(signal.SIGALRM, self._previous or signal.SIG_DFL)
            self._alarm = False

    # -- per batch --------------------------------------------------------------------------
    def fetch(self, batches: Iterator[Any]) -> Any:
        """``next(batches)``, turning a stall into :class:`DataStallError`."""
        watched = self._watched
        try:
            if watched:
                self._waiting = True
                self.waiting_since = time.monotonic()
            batch = next(batches)
            self._waiting = False
        except _DataTimeout as exc:
            raise DataStallError(self._hang_message(exc)) from None
        except DataStallError:
            raise  # the SIGCHLD translation already said it
        except (RuntimeError, OSError, EOFError) as exc:
            # OSError, EOFError: a worker died while handing over a batch
            raw = self.batches if self.batches is not None else batches  # not an islice of it
            error = self.explain(exc, raw)
            if error is None:
                raise
            self.abort(raw, hung="DataLoader timed out" in str(exc))
            raise error from exc
        finally:
            if watched:
                self._waiting = False
                self.waiting_since = None
        if not self._shm_checked and self.loader.num_workers:
            self._shm_checked = True
            self.check_shared_memory(batch)
        return batch

    def abort(self, batches: Any, hung: bool = False) -> None:
        """Stop the pass's workers now: torch's SIGCHLD handler would otherwise raise again at
        every later child exit, and the error's traceback keeps the iterator alive."""
        _GUARDS.discard(self)
        if hung:  # joining hung workers would wait for nothing
            for worker in getattr(batches, "_workers", ()):
                if worker.is_alive():
                    worker.kill()
        shutdown = getattr(batches, "_shutdown_workers", None)
        if callable(shutdown):
            with contextlib.suppress(RuntimeError):  # torch's SIGCHLD handler, once more
                shutdown()

    # -- messages ---------------------------------------------------------------------------
    def explain(self, exc: BaseException, batches: Any) -> DataStallError | None:
        """The :class:`DataStallError` for a loader failure torch reported (``None``: not one)."""
        text = str(exc)
        workers = self.loader.num_workers
        if "DataLoader timed out after" in text:
            return DataStallError(
                f"No batch came from the {workers} loader worker(s) within the data timeout "
                f"({self.timeout_s:g} s): the dataset's __getitem__ (or collate_fn) is stuck in a "
                "worker -- a hanging read (network filesystem, remote storage), a lock, or a "
                "deadlock after fork with threads. Fix: find where it blocks (`py-spy dump --pid "
                "<worker pid>`, or run with num_workers=0 to get the traceback here); if a batch "
                f"really takes that long, raise data_timeout_s (or {_ENV})."
            )
        signame = _worker_signal(text, batches)
        if signame is None:
            return None
        if signame in ("SIGBUS", "Bus error"):
            return DataStallError(
                f"A loader worker died of a bus error: /dev/shm is too small for the batches "
                f"the {workers} worker(s) hand to the training process ({_shm_text()}). "
                f"{_SHM_FIX}; or torch.multiprocessing.set_sharing_strategy('file_system')."
            )
        if signame in ("SIGKILL", "Killed"):
            return DataStallError(
                f"A loader worker was killed (SIGKILL), most likely by the kernel's out-of-memory "
                f"killer (`dmesg | grep -i oom` shows it): each of the {workers} worker(s) holds "
                "its own copy of what the dataset keeps in memory, plus its prefetched batches. "
                "Fix: fewer workers or prefetch_factor=1, load data lazily in __getitem__ instead "
                "of holding arrays in the dataset object (or keep them in numpy arrays / shared "
                "tensors, not Python lists), or give the job more memory."
            )
        return DataStallError(
            f"A loader worker died ({signame}); the batch it was loading is lost. The traceback "
            "above it in the log (if any) is the worker's. Fix the dataset code, or run with "
            f"num_workers=0 to debug it in this process. torch said: {text}"
        )

    def _hang_message(self, exc: _DataTimeout | None, frame: Any = None) -> str:
        frames = traceback.extract_tb(exc.__traceback__) if exc else traceback.extract_stack(frame)
        user = [f for f in frames if not is_internal(f.filename)]
        where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].name})" if user else ""
        return (
            f"The dataset produced no batch within the data timeout ({self.timeout_s:g} s); "
            f"it was stuck{where} (num_workers=0, so it runs in this process). A hanging read "
            "(network filesystem, remote storage) or a lock is the usual cause. Fix the wait, "
            f"or raise data_timeout_s (or {_ENV}) if a batch really takes that long."
        )

    def check_shared_memory(self, batch: Any) -> None:
        """Warn when the workers' batches in flight would not fit in ``/dev/shm``."""
        try:
            free = shutil.disk_usage(_SHM).free
        except OSError:
            return  # no /dev/shm (macOS, Windows): torch shares memory another way
        nbytes = sum(
            t.numel() * t.element_size()
            for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)
        )
        prefetch = self.loader.prefetch_factor or 2
        in_flight = nbytes * self.loader.num_workers * prefetch
        if in_flight > free:
            warn_at_user_code(SharedMemoryWarning(
                f"gpukit: the loader keeps about {format_bytes(in_flight)} of batches in /dev/shm "
                f"({format_bytes(nbytes)} per batch x {self.loader.num_workers} workers x "
                f"prefetch_factor {prefetch}), but only {format_bytes(free)} is free there; "
                f"workers will die with a bus error. {_SHM_FIX}."
            ))


_WATCHED: weakref.WeakSet[StallGuard] = weakref.WeakSet()  # guards without SIGALRM
_watchdog: threading.Thread | None = None
_watchdog_lock = threading.Lock()
_WATCH_PERIOD_S = 0.1  # how late past the timeout a stall is noticed, at most


def _watch(guard: StallGuard) -> None:
    """Have the one watchdog thread of the process look after ``guard``'s waits."""
    global _watchdog
    _WATCHED.add(guard)
    with _watchdog_lock:
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch_loop, name="gpukit-data-watchdog", daemon=True)
            _watchdog.start()


def _watch_loop() -> None:
    """Once a wait passes the timeout (once per wait): interrupt the waiting thread where its
    guard installed the SIGALRM handler, else print where the dataset is stuck."""
    while True:
        time.sleep(_WATCH_PERIOD_S)
        now = time.monotonic()
        for guard in list(_WATCHED):
            since = guard.waiting_since
            if since is None or since == guard.warned_since or now - since <= guard.timeout_s:
                continue
            guard.warned_since = since
            if guard._alarm and guard.watched_ident is not None:
                guard.kicked = True  # the handler ignores a kick that lands after the batch came
                signal.pthread_kill(guard.watched_ident, signal.SIGALRM)
                continue
            frame = sys._current_frames().get(guard.watched_ident or -1)
            print(f"gpukit: {guard._hang_message(None, frame)} (still waiting: this thread "
                  "cannot be interrupted)", file=sys.stderr, flush=True)


_GUARDS: weakref.WeakSet[StallGuard] = weakref.WeakSet()  # passes with workers under way


class _SigchldTranslator:
    """Wraps torch's SIGCHLD handler, which raises "DataLoader worker ... is killed by signal"
    wherever the training thread happens to be: the error becomes a DataStallError naming the
    cause and the fix, and the pass that owned the worker stops its other workers."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            if callable(self.previous):
                self.previous(signum, frame)
        except DataStallError:
            raise
        except RuntimeError as exc:
            pids = set(map(int, re.findall(r"pid\D*(\d+)", str(exc))))
            for guard in list(_GUARDS):
                workers = getattr(guard.batches, "_workers", ())
                if pids & {w.pid for w in workers}:
                    batches = guard.batches
                    error = guard.explain(exc, batches)
                    guard.abort(batches)
                    if error is not None:
                        raise error from exc
            raise


def _translate_sigchld() -> None:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGCHLD"):
        return
    current = signal.getsignal(signal.SIGCHLD)
    if callable(current) and not isinstance(current, _SigchldTranslator):  # torch's is set
        signal.signal(signal.SIGCHLD, _SigchldTranslator(current))


class _Handler:
    """SIGALRM while the guard waits: raise in the dataset's code; otherwise the old action."""

    def __init__(self, guard: StallGuard, previous: Any) -> None:
        self.guard, self.previous = guard, previous

    def __call__(self, signum: int, frame: Any) -> None:
        guard = self.guard
        kicked, guard.kicked = guard.kicked, False
        if guard._waiting:
            raise _DataTimeout()
        if kicked:  # the watchdog's signal, landing just after the batch came: nothing to do
            return
        signal.signal(signal.SIGALRM, self.previous or signal.SIG_DFL)  # not ours: as before
        os.kill(os.getpid(), signal.SIGALRM)


_KILLED = re.compile(r"killed by signal: ([\w ]+)")


def _worker_signal(text: str, batches: Any) -> str | None:
    """The signal that ended a worker, from torch's message or the workers' exit codes
    (``None``: every worker is alive -- the error is not a dead worker)."""
    match = _KILLED.search(text)
    if match:
        return match.group(1).strip()
    workers = list(getattr(batches, "_workers", ()))  # the DataLoader iterator's processes
    deadline = time.monotonic() + (2.0 if workers else 0.0)
    while True:  # a worker that just died may not be reaped yet
        for worker in workers:
            code = getattr(worker, "exitcode", None)
            if code is not None and code < 0:
                return signal_label(-code)
            if code is not None:
                return f"exit code {code}"
        if time.monotonic() >= deadline:
            return "exited unexpectedly" if "DataLoader worker" in text else None
        try:
            time.sleep(0.05)
        except RuntimeError as late:  # torch's SIGCHLD handler telling of the death now
            match = _KILLED.search(str(late))
            if match:
                return match.group(1).strip()


def _shm_text() -> str:
    try:
        usage = shutil.disk_usage(_SHM)
    except OSError:
        return "no /dev/shm found"
    return f"{_SHM}: {format_bytes(usage.free)} free of {format_bytes(usage.total)}"
