"""This machine's name, without importing :mod:`socket` (``gpukit ls`` names the host in claims and
the per-user claim folder, and must start fast: socket pulls in selectors, enum tables and more)."""

from __future__ import annotations

import os

__all__ = ["host_name"]


def host_name() -> str:
    """What ``socket.gethostname()`` returns: the kernel's node name (``uname -n``)."""
    try:
        return os.uname().nodename
    except AttributeError:  # Windows: no uname
        import socket

        return socket.gethostname()
