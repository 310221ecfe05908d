"""The collective timeout's unit check: how long a collective waits for a rank that stopped.

``Session(timeout_s=)``, else ``GPUKIT_TIMEOUT_S`` (what ``gpukit run --timeout`` sets for its
workers; read by ``gpukit.worker.collective_timeout_s``), else 1800 s; then a collective raises
instead of hanging. Torch-free: the launcher validates ``--timeout`` with it before starting anything.
"""

from __future__ import annotations

import math
from typing import Any

from gpukit.errors import ConfigurationError

__all__ = ["DEFAULT_TIMEOUT_S", "parse_timeout_s"]

DEFAULT_TIMEOUT_S = 1800.0


def parse_timeout_s(value: Any, source: str = "timeout_s") -> float:
    """``value`` as a positive finite number of seconds.

    Raises:
        ConfigurationError: not a number, not finite, or not positive.
    """
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"{source}={value!r}; the collective timeout must be a positive, finite number of "
            "seconds (e.g. 600). It is how long a collective waits for a rank that stopped."
        )
    return seconds
