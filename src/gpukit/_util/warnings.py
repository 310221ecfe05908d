"""Warnings that point at the user's line, not at gpukit's or torch's internals."""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_at_user_code", "user_stacklevel", "is_internal"]

# gpukit's own directory is two up from this file (gpukit/_util/warnings.py)
_GPUKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_DIRS = tuple(
    directory + os.sep
    for directory in (_GPUKIT_DIR, os.path.dirname(os.path.abspath(torch.__file__ or "")))
    if directory
)


def is_internal(filename: str) -> bool:
    """Whether ``filename`` lies in the installed gpukit or torch package (by their real
    directories: a user's own folder named ``gpukit`` is user code)."""
    return os.path.abspath(filename).startswith(_INTERNAL_DIRS)


def user_stacklevel() -> int:
    """The ``stacklevel`` that, passed to ``warnings.warn`` by the caller, names user code.

    Counts from the caller's frame (level 1) outwards past every frame in the gpukit and
    torch packages (hooks, ``nn.Module.__call__``, Session methods).
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def warn_at_user_code(warning: Warning) -> None:
    """``warnings.warn(warning)`` attributed to the first frame outside gpukit and torch."""
    warnings.warn(warning, stacklevel=user_stacklevel())
