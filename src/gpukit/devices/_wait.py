"""Waiting: run an attempt until it succeeds, showing on stderr what it waits for."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TypeVar

from gpukit.errors import ConfigurationError, GpuSelectionError

__all__ = ["poll"]

T = TypeVar("T")


def poll(attempt: Callable[[], tuple[T | None, Callable[[float | None], GpuSelectionError]]], *,
         wait: bool | Callable[[], bool],
         timeout_s: float | None, poll_interval_s: float, what: str,
         interval: Callable[[], float] | None = None) -> T:
    """Run ``attempt`` until it returns a result; while waiting, show on stderr what it waits for.

    ``attempt`` returns ``(result, make_error)``; ``make_error(waited_s)`` builds the error to
    raise when giving up (``waited_s`` is ``None`` when not waiting at all). ``interval``, when
    given, says how long to pause before the next attempt (default ``poll_interval_s``). ``wait``
    may be a function, asked after each failed attempt (whether to keep trying).
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or timeout_s < 0):
        raise ConfigurationError(f"timeout_s={timeout_s!r}: give seconds >= 0, or None to wait without limit.")
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    with _WaitStatus(what) as status:
        while True:
            result, make_error = attempt()
            if result is not None:
                return result
            if not (wait() if callable(wait) else wait):
                raise make_error(None)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise make_error(now - start)
            status.update(str(make_error(None)).splitlines(), now - start)
            every = poll_interval_s if interval is None else interval()
            pause = every if deadline is None else min(every, max(deadline - now, 0.0))
            time.sleep(pause)


class _WaitStatus:
    """A rich status line on an interactive stderr; otherwise one stderr line per change of state."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._status: Any = None  # rich.status.Status, imported only when shown
        self._last: str | None = None

    def __enter__(self) -> _WaitStatus:
        return self

    def update(self, report: list[str], waited_s: float) -> None:
        busy = [line.strip() for line in report[1:-1] if not line.rstrip().endswith(": ok")]
        summary = f"waiting for {self.what}: " + ("; ".join(busy) if busy else report[0])
        if sys.stderr.isatty():
            if self._status is None:
                from rich.console import Console

                self._status = Console(stderr=True).status(summary)
                self._status.start()
            self._status.update(f"{summary} [{waited_s:.0f} s]")
        elif summary != self._last:
            print(f"gpukit: {summary}", file=sys.stderr, flush=True)
        self._last = summary

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
