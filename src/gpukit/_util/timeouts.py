"""The collective timeout: how long a collective waits for a rank that stopped.

``Session(timeout_s=)``, else ``GPUKIT_TIMEOUT_S`` (what ``gpukit run --timeout`` sets for its
workers), else 1800 s; then a collective raises instead of hanging. Torch-free: the launcher
validates ``--timeout`` with it before starting anything.
"""

from __future__ import annotations

import math
import os
from typing import Any

from gpukit._util.envvars import TIMEOUT_ENV
from gpukit.errors import ConfigurationError

__all__ = ["TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "parse_timeout_s", "collective_timeout_s"]

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


def collective_timeout_s(value: float | None = None) -> float:
    """The timeout to use: ``value``, else ``GPUKIT_TIMEOUT_S``, else 1800 s (all validated)."""
    if value is not None:
        return parse_timeout_s(value)
    env = os.environ.get(TIMEOUT_ENV)
    return parse_timeout_s(env, TIMEOUT_ENV) if env else DEFAULT_TIMEOUT_S
