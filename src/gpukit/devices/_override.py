"""The in-process NVML backend override: the FakeNvml that ``FakeNvml.install()`` put in place.

Kept apart from :mod:`gpukit.devices._nvml` (which reads it) and :mod:`gpukit.devices._fake`
(which sets it) so that neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["backend_override", "set_backend_override"]

_override: Any | None = None


def set_backend_override(fake: Any | None) -> None:
    """Use ``fake`` (a FakeNvml) as the backend in this process; ``None`` goes back to env/real."""
    global _override
    _override = fake  # one assignment: a reader sees the old or the new fake, never half of one


def backend_override() -> Any | None:
    """The installed fake, or ``None``."""
    return _override
