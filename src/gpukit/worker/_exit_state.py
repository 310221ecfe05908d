"""What a worker's exit path needs to know about this process: is it failing, and does a
strategy leave a process group in an exit hook (``strategies/_lifecycle.py`` sets both; the script
worker's exit in ``_entry.py`` reads them). Kept here, below the strategies, so the worker never
looks the strategies' module up by name."""

from __future__ import annotations

__all__ = ["note_failure", "is_failing", "note_group_to_leave", "leaves_a_group_at_exit"]

_failing = False
_group_to_leave = False


def note_failure() -> None:
    """Mark this process as failing: an exit hook must not wait at a barrier for its peers."""
    global _failing
    _failing = True


def is_failing() -> bool:
    return _failing


def note_group_to_leave() -> None:
    """A strategy created a process group and registered the exit hook that leaves it."""
    global _group_to_leave
    _group_to_leave = True


def leaves_a_group_at_exit() -> bool:
    """Whether a strategy in this process created a process group that its exit hook leaves."""
    return _group_to_leave
