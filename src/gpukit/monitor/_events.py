"""Run events (OOM back-off, leak warning, checkpoint, preemption, restart) for whoever listens.

The places where such things happen call :func:`emit` -- one line each -- and know nothing of
who listens; the run recorder subscribes. With no subscriber ``emit`` costs one list check.
``emit`` may be called from a signal handler (preemption): subscribers must not block or take
locks the interrupted code might hold (the recorder only appends to a deque).
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["EVENT_KINDS", "emit", "subscribe", "unsubscribe"]

EVENT_KINDS = ("oom_backoff", "leak_warning", "checkpoint", "preemption", "restart")

Listener = Callable[[str, float, dict[str, Any]], None]
_LISTENERS: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call ``listener(kind, unix_time_s, fields)`` for every event from now on."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def unsubscribe(listener: Listener) -> None:
    """Stop calling ``listener`` (no error if it was not subscribed)."""
    try:
        _LISTENERS.remove(listener)
    except ValueError:
        pass


def emit(kind: str, **fields: Any) -> None:
    """Tell the subscribers that ``kind`` (one of :data:`EVENT_KINDS`) happened.

    ``fields`` are JSON-friendly details (numbers, strings). A failing subscriber never
    breaks the run: what went wrong in training matters more than its record.
    """
    if not _LISTENERS:
        return
    now = time.time()
    for listener in list(_LISTENERS):
        try:
            listener(kind, now, fields)
        except Exception:  # noqa: BLE001 - recording is best effort, training is not
            pass
