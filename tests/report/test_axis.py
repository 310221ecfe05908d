"""The tick chooser: round 1-2-5 steps in a unit chosen per axis, over many ranges."""

from __future__ import annotations

import math
import random

import pytest

from gpukit.report._axis import axis_for, nice_step, nice_ticks

_UNITS = {"seconds": {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0},
          "bytes": {"B": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40}}


def _is_125(step: float) -> bool:
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (1, 2, 5))


def _check(low: float, high: float, kind: str) -> None:
    axis = axis_for(low, high, kind)
    ticks, span = axis.ticks, max(high - low, abs(high) * 1e-9, 1e-300)
    assert ticks == sorted(ticks) and 3 <= len(ticks) <= 12, (low, high, kind, ticks)
    assert ticks[0] <= low + span * 1e-6 and ticks[-1] >= high - span * 1e-6, (low, high, ticks)
    unit = _UNITS[kind][axis.unit] if kind in _UNITS else 1.0
    steps = [(b - a) / unit for a, b in zip(ticks, ticks[1:])]
    assert all(math.isclose(s, steps[0], rel_tol=1e-6) for s in steps) and _is_125(steps[0]), (low, high, ticks)
    labels = [axis.label(t) for t in ticks]
    assert len(set(labels)) == len(labels), labels  # every tick reads differently
    if kind in _UNITS:
        assert all(label.endswith(" " + axis.unit) for label in labels), labels
        assert not any("e+" in label or "e-" in label for label in labels), labels
        largest = max(_UNITS[kind].values())
        assert max(abs(t) for t in ticks) / unit < 2000 or unit == largest, (axis.unit, labels)  # the unit fits


@pytest.mark.parametrize("kind", ["seconds", "bytes", "number"])
def test_ticks_are_round_cover_the_range_and_read_in_one_unit(kind: str) -> None:
    rng = random.Random(7)
    for _ in range(2000):
        exponent = rng.uniform(-6, 12) if kind != "number" else rng.uniform(-8, 12)
        high = 10**exponent * rng.uniform(1, 10)
        low = 0.0 if rng.random() < 0.4 else high * rng.uniform(0, 0.999)
        _check(low, high, kind)
    for low, high in ((0, 1), (0, 1000), (1, 5), (0.001, 0.0042), (999, 1001), (5, 5), (0, 0), (-3, 7)):
        _check(float(low), float(high), kind)


def test_the_issue_axis_reads_in_seconds_not_thousands_of_ms() -> None:
    axis = axis_for(1.0, 5.0, "seconds")
    assert [axis.label(t) for t in axis.ticks] == ["1 s", "2 s", "3 s", "4 s", "5 s"]
    small = axis_for(0.0, 0.012, "seconds")
    assert [small.label(t) for t in small.ticks] == ["0 ms", "5 ms", "10 ms", "15 ms"]
    assert axis_for(0, 5400, "seconds").unit == "h" and axis_for(0, 600, "seconds").unit == "min"
    memory = axis_for(0, 3 * 2**30, "bytes")
    assert [memory.label(t) for t in memory.ticks] == ["0 GiB", "1 GiB", "2 GiB", "3 GiB"]
    fine = axis_for(0, 3 * 2**30, "bytes", count=6)
    assert [fine.label(t) for t in fine.ticks] == ["0.0 GiB", "0.5 GiB", "1.0 GiB", "1.5 GiB", "2.0 GiB",
                                                   "2.5 GiB", "3.0 GiB"]
    steps = axis_for(0, 1_000_000, "number", count=6)
    assert [steps.label(t) for t in steps.ticks] == ["0", "200k", "400k", "600k", "800k", "1,000k"]


def test_nice_step_and_ticks() -> None:
    assert [nice_step(x) for x in (0.7, 1.0, 1.2, 3, 7, 11, 0.003)] == [1, 1, 2, 5, 10, 20, 0.005]
    assert nice_ticks(0, 9.3) == [0, 2, 4, 6, 8, 10]
    assert nice_ticks(0.1, 0.7, count=6) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]  # no 0.30000000000000004
    assert nice_ticks(float("nan"), 1) == [0.0, 1.0]
