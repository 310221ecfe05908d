"""Text another user (or a file) wrote, made safe to show on a terminal.

A run id in a claim note, a process's command line, a tensor name in a checkpoint: any of them can
hold escape sequences that move the cursor, rewrite earlier lines, retitle the window or hide text
(``\\x1b]0;...\\x07``, ``\\x1b[2J``, bidi overrides). :func:`printable` escapes every character that
is not printable (C0/C1 controls, DEL, format characters such as U+202E, line separators) the way
``repr`` would, so what was there stays visible and nothing reaches the terminal as a command.
"""

from __future__ import annotations

__all__ = ["printable"]


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: object, *, keep_newlines: bool = False, max_chars: int | None = None) -> str:
    """``str(text)`` with every non-printable character escaped (``\\x1b``, ``\\u202e``).

    Args:
        text: anything; ``None`` gives ``"None"``, as ``str`` would.
        keep_newlines: keep ``\\n`` (multi-line messages); every other control is escaped.
        max_chars: cut the *escaped* text to this many characters, ending with ``…``.
    """
    value = text if isinstance(text, str) else str(text)
    if max_chars is not None and len(value) > 4 * max_chars:  # escaping never shortens: cut early
        value = value[: 4 * max_chars]
    if not value.isprintable():
        value = "".join(ch if ch.isprintable() or (keep_newlines and ch == "\n") else _escape(ch) for ch in value)
    if max_chars is not None and len(value) > max_chars:
        value = value[: max(0, max_chars - 1)] + "…"
    return value
