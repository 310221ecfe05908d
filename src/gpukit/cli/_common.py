"""Helpers shared by the commands (no torch import: ``ls`` and ``select`` use them).

Numeric options use the validated click types below, so a bad value is one usage line
(``gpukit: error: Invalid value for '--grace': ...``, exit 2) before anything starts:
``nan`` and ``inf`` pass click's own ``FloatRange`` (every comparison with NaN is false),
and huge integers would reach torch or ``time.sleep`` and fail there with a traceback.
"""

from __future__ import annotations

import math
from typing import Any

import click

from gpukit._util.units import parse_size
from gpukit.errors import ConfigurationError

__all__ = [
    "FiniteFloatRange",
    "MAX_DURATION_S",
    "MAX_SEED",
    "MAX_BATCH",
    "parse_size_option",
    "parse_wait_seconds",
]

#: longest duration an option accepts (~116 days); beyond it ``time.sleep`` and friends overflow
MAX_DURATION_S = 10_000_000
#: torch.manual_seed takes 64-bit seeds; 2**63 - 1 keeps seed + rank / + epoch in range
MAX_SEED = 2**63 - 1
#: largest batch dimension or batch size an option accepts (torch indexes with int64)
MAX_BATCH = 2**31 - 1


class FiniteFloatRange(click.FloatRange):
    """A ``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which ``FloatRange`` lets through)."""

    def __init__(self, min: float | None = None, max: float | None = MAX_DURATION_S, *,
                 min_open: bool = False, unit: str = "seconds") -> None:
        super().__init__(min=min, max=max, min_open=min_open)
        self.unit = unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of {self.unit}; give a number in the range "
                      f"{self._describe_range()}.", param, ctx)
        return super().convert(number, param, ctx)


def parse_size_option(option: str, value: str | None) -> int | None:
    """``--min-free 8GiB`` -> bytes; a bad value is an error that names the option."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{option}: {exc}") from None


def parse_wait_seconds(value: str) -> float:
    """``--wait TIMEOUT`` -> seconds; ``inf`` means no limit. NaN, negatives and absurd values are usage errors."""
    try:
        seconds = float(value)
    except ValueError:
        raise click.UsageError(f"--wait {value!r}: give the longest wait in seconds (e.g. --wait 600), "
                               "or --wait alone to wait without limit.") from None
    if math.isnan(seconds) or seconds < 0 or MAX_DURATION_S < seconds < math.inf:
        raise click.UsageError(f"--wait {value!r}: a timeout cannot be negative or NaN; give seconds from 0 to "
                               f"{MAX_DURATION_S:,} (e.g. --wait 600), or --wait alone to wait without limit.")
    return seconds
