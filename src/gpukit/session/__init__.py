"""The Session: the facade users hold (``gpukit.Session``), and the components it delegates to."""

from __future__ import annotations

from gpukit.session._session import Session

__all__ = ["Session"]
