"""The Session's trackers in one place: started once on rank 0, fed without a device sync per call.

:class:`TrackerHub` holds the trackers of ``Session(log_with=...)`` (:mod:`gpukit.monitor._trackers`).
``log`` only queues (step, name, value); tensors stay tensors until a flush, every ``flush_every_s``
seconds, which starts reading all queued device tensors back in one transfer per device without
waiting (:mod:`gpukit.monitor._lazy_read`) and sends the rows whose numbers are in -- those of the
flush before, usually; ``close`` waits for the last ones. A value
logged by gpukit itself (the loss given to ``session.backward``, the gradient norm) is a default: a
value the user logs under the same name at the same step replaces it.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import ConfigurationError
from gpukit.monitor._lazy_read import LazyRead
from gpukit.monitor._trackers import Tracker, check_run_name

__all__ = ["TrackerHub"]


class TrackerHub:
    """The trackers of one Session (see the module docstring).

    Args:
        trackers: what ``log_with`` named; only rank 0 uses them.
        rank: this process's rank.
        directory: the run-record directory, ``None`` when not recording (then ``gpukit_logs/<run>``).
        settings: the session's own settings, logged with the run's configuration.
        flush_every_s: seconds between flushes.
    """

    def __init__(self, trackers: list[Tracker], *, rank: int, directory: Path | None,
                 settings: dict[str, Any], flush_every_s: float = 2.0) -> None:
        self.trackers = trackers if rank == 0 else []
        self._directory = directory
        self._settings = settings
        self._flush_every_s = flush_every_s
        self._started = False
        self._pending: dict[int, dict[str, tuple[Any, bool]]] = {}
        self._last_flush = time.monotonic()
        self._reading: list[tuple[LazyRead, dict[int, dict[str, Any]]]] = []  # rows whose numbers are on their way
        self.run_name: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.trackers)

    def init(self, run_name: str | None, config: dict[str, Any] | None) -> None:
        """Start the run with its name and configuration (``session.init_trackers``).

        Raises:
            ConfigurationError: the trackers already started (at a first ``session.log``), or
                ``run_name`` would not name one folder inside ``gpukit_logs`` (:func:`check_run_name`).
        """
        if self._started:
            raise ConfigurationError(
                "session.init_trackers(...) came after the trackers started (at the first session.log or "
                "session.backward); call it before the training loop."
            )
        if config is not None and not isinstance(config, dict):
            raise ConfigurationError(f"init_trackers(config={type(config).__name__}); pass a dict.")
        if run_name is not None and self._directory is None:  # it names a folder: it must stay in gpukit_logs
            check_run_name(run_name)
        self._start(run_name, config or {})

    def _start(self, run_name: str | None, config: dict[str, Any]) -> None:
        self._started = True
        if not self.trackers:
            return
        if run_name is None:
            run_name = (self._directory.name if self._directory is not None
                        else datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S"))
        self.run_name = run_name
        directory = self._directory if self._directory is not None else Path("gpukit_logs") / run_name
        full = {**config, "gpukit": self._settings}
        for tracker in self.trackers:
            tracker.start(run_name, full, directory)

    def log(self, step: int, scalars: dict[str, Any], *, default: bool = False) -> None:
        """Queue ``scalars`` for ``step`` (checked by the caller); flush when it is time."""
        if not self.trackers:
            return
        if not self._started:
            self._start(None, {})
        slot = self._pending.setdefault(step, {})
        for name, value in scalars.items():
            if default and name in slot and not slot[name][1]:
                continue  # the user's own value of this name wins
            slot[name] = (value, default)
        if time.monotonic() - self._last_flush >= self._flush_every_s:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Start reading what is queued (device tensors in one transfer per device, not waited for)
        and send the rows whose numbers are in. The newest step waits for the next flush unless
        ``final`` (which also waits for the reads): more of its values may still come."""
        self._last_flush = time.monotonic()
        newest = max(self._pending) if self._pending else None
        pending = {step: slot for step, slot in self._pending.items() if final or step != newest}
        self._pending = {step: slot for step, slot in self._pending.items() if step not in pending}
        rows = {step: {name: value for name, (value, _) in slot.items()} for step, slot in sorted(pending.items())}
        if rows:
            self._reading.append((LazyRead([(scalars, name) for scalars in rows.values() for name in scalars]), rows))
        while self._reading:  # in order: a row is sent once it and every row before it are numbers
            read, rows = self._reading[0]
            if final:
                read.finish()
            elif not read.done():
                return
            self._reading.pop(0)
            self._send(rows)

    def _send(self, rows: dict[int, dict[str, Any]]) -> None:
        for scalars in rows.values():
            for name, value in scalars.items():
                scalars[name] = float(value)
        for tracker in list(self.trackers):
            try:
                for step, scalars in rows.items():
                    tracker.log(step, scalars)
            except Exception as exc:  # noqa: BLE001 - a tracker that fails must not stop training
                self.trackers.remove(tracker)
                warn_at_user_code(RuntimeWarning(
                    f"The {tracker.name} tracker failed ({type(exc).__name__}: {exc}); it logs nothing more "
                    "in this run (the run record and the other trackers go on)."
                ))

    def close(self) -> None:
        """Flush and finish every tracker's run. Idempotent."""
        if not self.trackers:
            return
        self.flush(final=True)
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
