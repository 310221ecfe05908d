"""Run events (OOM back-off, leak warning, checkpoint, preemption, restart) for whoever listens.

The places where such things happen call :func:`emit` -- one line each -- and know nothing of
who listens; the run recorder subscribes. With no subscriber ``emit`` costs one list check.
``emit`` may be called from a signal handler (preemption): subscribers must not block or take
locks the interrupted code might hold (the recorder only appends to a deque).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable

from gpukit.errors import ConfigurationError

__all__ = ["EVENT_KINDS", "check_event", "emit", "subscribe", "unsubscribe"]

EVENT_KINDS = ("oom_backoff", "leak_warning", "checkpoint", "preemption", "restart")
_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]{0,63}$")
_MAX_FIELDS = 16
_MAX_TEXT_CHARS = 200

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


def check_event(kind: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` of a user event (``session.log_event``) if ``kind`` and they are recordable.

    A kind is a short name (a letter, then letters, digits, ``_ . -``; 64 characters at most);
    fields are at most 16 numbers, strings (200 characters at most), booleans or ``None``.

    Raises:
        ConfigurationError: saying which value is not allowed and what is.
    """
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise ConfigurationError(
            f"session.log_event({kind!r:.80}): the event kind must be a short name (a letter, then letters, "
            "digits, '_', '.' or '-'; at most 64 characters), e.g. log_event('checkpoint', path=str(path)).")
    if len(fields) > _MAX_FIELDS:
        raise ConfigurationError(f"session.log_event({kind!r}) got {len(fields)} fields; at most {_MAX_FIELDS}.")
    for name, value in fields.items():
        ok = (value is None or isinstance(value, bool) or (isinstance(value, str) and len(value) <= _MAX_TEXT_CHARS)
              or (isinstance(value, int) and abs(value) < 2**63)
              or (isinstance(value, float) and math.isfinite(value)))
        if name in ("type", "t", "kind", "step") or not ok:
            raise ConfigurationError(
                f"session.log_event({kind!r}, {name}={value!r:.80}): fields are numbers, strings of at most "
                f"{_MAX_TEXT_CHARS} characters, booleans or None, named other than type, t, kind and step.")
    return fields
