"""Axis ticks for the report's charts: round values (1-2-5 steps) in a unit chosen per axis.

A time axis reads in ms, s, min or h and a byte axis in B, KiB ... TiB, whichever makes its
largest value a number under a thousand-ish, so ticks read "200 ms", "1.5 s" or "4 GiB" rather
than "1e+03 ms". Other axes get plain numbers, with k / M / G for large ones (step counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

__all__ = ["Axis", "axis_for", "nice_step", "nice_ticks"]

_TIME_UNITS = ((3600.0, "h"), (60.0, "min"), (1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))
_BYTE_UNITS = ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B"))
_SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


@dataclass(frozen=True)
class Axis:
    """Tick values (in the data's own unit: seconds, bytes...) and how to label one."""

    ticks: list[float]
    label: Callable[[float], str]
    unit: str  # "" for plain numbers


def nice_step(raw: float) -> float:
    """The smallest 1, 2 or 5 x 10^k that is at least ``raw`` (> 0)."""
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * magnitude >= raw * (1 - 1e-12):
            return m * magnitude
    return 10 * magnitude  # pragma: no cover - the loop always returns


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2, 5 x 10^k steps) from at or below ``low`` to at or above ``high``."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high < low:
        low, high = high, low
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    step = nice_step((high - low) / max(1, count))
    first = math.floor(low / step + 1e-9)
    last = math.ceil(high / step - 1e-9)
    return [_clean(i * step, step) for i in range(first, last + 1)]


def _clean(value: float, step: float) -> float:
    """``value`` rounded to the decimals ``step`` has (no 0.30000000000000004)."""
    digits = max(0, -math.floor(math.log10(step))) + 1
    return round(value, digits) + 0.0  # + 0.0: no "-0"


def _decimals(step: float) -> int:
    """Decimals that tell ticks ``step`` apart (a 1-2-5 step needs at most one digit past its own)."""
    return max(0, -math.floor(math.log10(step) + 1e-9))


def _plain(value: float, decimals: int) -> str:
    return f"{value:,.{decimals}f}"


def _unit_for(peak: float, units: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    return next(((size, name) for size, name in units if peak >= size), units[-1])


def axis_for(low: float, high: float, kind: str = "number", count: int = 5) -> Axis:
    """Ticks covering ``[low, high]`` for values of ``kind``: ``"seconds"``, ``"bytes"`` or ``"number"``."""
    peak = max(abs(low), abs(high))
    if kind in ("seconds", "bytes"):
        units = _TIME_UNITS if kind == "seconds" else _BYTE_UNITS
        size, name = _unit_for(peak, units)
        if kind == "seconds" and name == "h" and peak >= 1000 * 3600:
            size, name = 86400.0, "d"
        scaled = nice_ticks(low / size, high / size, count)
        step = scaled[1] - scaled[0] if len(scaled) > 1 else 1.0
        decimals = _decimals(step)
        return Axis([t * size for t in scaled], lambda v: f"{_plain(v / size, decimals)} {name}", name)
    ticks = nice_ticks(low, high, count)
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    return Axis(ticks, _number_label(peak, step), "")


def _number_label(peak: float, step: float) -> Callable[[float], str]:
    for size, suffix in _SUFFIXES:
        if peak >= 10 * size and step >= size / 10:
            decimals = _decimals(step / size)
            return lambda v: f"{_plain(v / size, decimals)}{suffix}" if v else "0"
    if step < 1e-3:  # tiny values (a learning rate): scientific, with the step's precision
        digits = max(1, _decimals(step) - _decimals(peak) + 1) if peak else 1
        return lambda v: f"{v:.{digits - 1}e}" if v else "0"
    decimals = _decimals(step)
    return lambda v: _plain(v, decimals)
