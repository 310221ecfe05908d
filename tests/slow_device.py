"""A fake CUDA device whose copies finish when the test says so: each device event stays "not passed"
until the test sets ``event.passed = True`` (or something waits on it), so the code under test can be
seen never to wait (tests/data/test_pinned.py, tests/monitor/test_lazy_read.py)."""

from __future__ import annotations

from typing import Any

from gpukit.accelerators import FakeCUDAAccelerator

__all__ = ["HandPassedEvent", "SlowDevice"]


class HandPassedEvent:
    """A device event the test passes by hand (the device is "still copying" until then)."""

    def __init__(self) -> None:
        self.passed = False

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True  # a wait: the device finished


class SlowDevice(FakeCUDAAccelerator):
    """Its copies finish when the test says so; ``events`` are the events it made, in order."""

    def __init__(self) -> None:
        self.events: list[HandPassedEvent] = []

    def _new_event(self) -> Any:
        self.events.append(HandPassedEvent())
        return self.events[-1]
