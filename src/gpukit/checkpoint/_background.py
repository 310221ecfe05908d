"""Background saves: the training loop waits only for a host copy of the state.

``save_checkpoint(..., background=True)`` (and ``gpukit.save(..., background=True)``) split a
save in two:

1. on the calling thread, blocking: wait for the previous background save if one is still
   writing (at most one is in flight: it owns the host buffers), raise its error if it failed,
   then copy the state into host memory (:mod:`gpukit.checkpoint._snapshot`: reused buffers,
   pinned for GPU tensors) and prepare the target;
2. in a thread: write the files (tensor bytes outside the GIL, ``_zipwrite``), fsync them,
   commit atomically (rename), rotate old checkpoints, and record how long it all took.

A crash or SIGKILL during step 2 leaves what a crash during a plain save leaves: the
previous complete checkpoint, never a torn one (the commit is the same rename). An error in
step 2 is kept and raised by the next save, :func:`wait_for_saves`, ``session.resume`` or
``session.close``, on every rank alike; at interpreter exit the in-flight save is waited for
(bounded by the checkpoint timeout) and an unreported error printed -- never dropped.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gpukit.checkpoint._snapshot import HostBuffers
from gpukit.errors import CheckpointError

__all__ = ["SaveTimings", "BackgroundSaves", "background_saves", "wait_for_saves", "last_save_timings"]

#: A save that waited longer than this for the previous one says so once (saves outpace the disk).
_WAIT_NOTE_S = 0.5


@dataclass
class SaveTimings:
    """How long one save took, and how long the training loop waited for it.

    Attributes:
        what: what was saved ("step 120 to runs/ckpt", "model.pt").
        background: written in the background.
        waited_s: the part of ``blocked_s`` spent waiting for the previous background save
            (at most one is in flight); above zero when saves come faster than they are written.
        snapshot_s: copying the state to host memory (background saves).
        blocked_s: how long the call blocked the caller (everything, for a plain save).
        write_s: writing, fsync, the atomic commit and rotation (``None`` until done).
        total_s: from the call to the checkpoint being complete (``None`` until done).
        host_bytes: bytes copied to host memory (the background save's memory cost).
    """

    what: str
    background: bool
    waited_s: float = 0.0
    snapshot_s: float = 0.0
    blocked_s: float = 0.0
    write_s: float | None = None
    total_s: float | None = None
    host_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Pending:
    def __init__(self, timings: SaveTimings, thread: threading.Thread) -> None:
        self.timings = timings
        self.thread = thread
        self.error: BaseException | None = None


class BackgroundSaves:
    """This process's background saves: one in flight at most, its failure kept for the next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        self._failure: CheckpointError | None = None  # failed, not yet raised to the caller
        self._pid = os.getpid()
        self._noted_wait = False
        #: host memory snapshots copy into, kept between saves
        self.buffers = HostBuffers()
        #: timings of the last save started (background or not)
        self.last: SaveTimings | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a background save is still writing."""
        pending = self._pending
        return pending is not None and pending.thread.is_alive()

    def wait(self, timeout_s: float | None = None, *, raise_error: bool = True) -> float:
        """Wait for the in-flight save (if any); returns the seconds waited.

        Raises:
            CheckpointError: the save (or an earlier unreported one) failed -- raised once;
                or it is still writing after ``timeout_s``.
        """
        start = time.perf_counter()
        pending = self._pending
        if pending is not None and os.getpid() == self._pid:
            pending.thread.join(timeout_s)
            if pending.thread.is_alive():
                raise CheckpointError(
                    f"The background save of {pending.timings.what} is still writing after {timeout_s:g} s "
                    "(a slow or stuck file system?); the previous checkpoint is the newest complete one.")
            self._settle(pending)
        waited = time.perf_counter() - start
        if raise_error:
            self.raise_failure()
        return waited

    def _settle(self, pending: _Pending) -> None:
        with self._lock:
            if self._pending is not pending:
                return
            self._pending = None
            if pending.error is not None and self._failure is None:
                error = pending.error
                text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
                self._failure = CheckpointError(f"The background save of {pending.timings.what} failed: {text}")
                self._failure.__cause__ = error

    def raise_failure(self) -> None:
        """Raise the failure of a finished background save not reported yet (once)."""
        pending = self._pending
        if pending is not None and not pending.thread.is_alive():
            self._settle(pending)
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def submit(self, timings: SaveTimings, work: Callable[[], None]) -> None:
        """Run ``work`` (write, commit) in a thread; call only after :meth:`wait` returned."""
        if timings.waited_s > _WAIT_NOTE_S and not self._noted_wait:
            self._noted_wait = True
            print(f"gpukit: saving {timings.what} waited {timings.waited_s:.2f} s for the previous background "
                  "save to finish (one is in flight at a time): checkpoints come faster than they are written.",
                  file=sys.stderr, flush=True)
        begun = time.perf_counter() - timings.blocked_s

        def run() -> None:
            written = time.perf_counter()
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept and raised at the next call
                pending.error = exc
            finally:
                done = time.perf_counter()
                timings.write_s = done - written
                timings.total_s = done - begun

        thread = threading.Thread(target=run, name="gpukit-background-save", daemon=True)
        pending = _Pending(timings, thread)
        with self._lock:
            self._pending = pending
            self.last = timings
        _register_exit_wait()
        thread.start()

    def at_exit(self, timeout_s: float) -> None:
        """Wait for the in-flight save; print a failure nobody was told of (exit cannot raise it)."""
        if os.getpid() != self._pid:
            return  # a forked child: the thread and its save belong to the parent
        try:
            self.wait(timeout_s)
        except CheckpointError as exc:
            print(f"gpukit: {exc}", file=sys.stderr, flush=True)


_saves: BackgroundSaves | None = None
_saves_lock = threading.Lock()
_exit_registered = False


def background_saves() -> BackgroundSaves:
    """The process's :class:`BackgroundSaves` (created on first use)."""
    global _saves
    with _saves_lock:
        if _saves is None:
            _saves = BackgroundSaves()
        return _saves


def _register_exit_wait() -> None:
    # registered at the first background save, after the strategy's exit hook that leaves the
    # process group (atexit runs last-in first-out): the save's commit still has its peers
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_wait_at_exit)


def _wait_at_exit() -> None:
    if _saves is not None:
        from gpukit.checkpoint._dist import timeout_s

        try:
            limit = timeout_s()
        except CheckpointError:
            limit = 300.0
        _saves.at_exit(limit)


def wait_for_saves(timeout_s: float | None = None) -> SaveTimings | None:
    """Wait until the in-flight background save (if any) is complete on disk.

    Call it before anything that needs the checkpoint to exist (copying it elsewhere, ending a
    job by other means than returning). ``session.close()`` and interpreter exit (preemption
    included) wait too.

    Returns:
        The timings of the last save (``None`` when there was none).

    Raises:
        CheckpointError: the background save failed (the previous checkpoint is the newest
            complete one), or is still writing after ``timeout_s``.
    """
    saves = background_saves()
    saves.wait(timeout_s)
    return saves.last


def last_save_timings() -> SaveTimings | None:
    """Timings of the last save started in this process (background or not), or ``None``."""
    return _saves.last if _saves is not None else None
