"""Leak detection: memory that grows step after step, and the variable that makes it grow.

Call ``watcher.step()`` once per training step (or let an optimizer hook call it). Every
``every_n_steps`` the watcher runs a cheap check:

1. the user's frames are scanned for tensors with autograd history and tensor containers
   (:mod:`gpukit.memory._survivors`), which names ``total_loss += loss`` within two checks and
   lists that grow with graphs or device tensors attached;
2. memory is sampled -- allocated bytes on an accelerator (a counter read), live CPU tensor
   bytes on the CPU (a garbage-collector walk, rationed to ``max_overhead`` of the time spent in
   steps because it costs tens of milliseconds) -- and a leak is a window of samples whose
   later half lies entirely above its earlier half by at least a minimum growth.

Findings are warned once each (:class:`MemoryLeakWarning`) and kept in ``watcher.findings``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpukit._util.units import MIB, format_bytes
from gpukit._util.warnings import warn_at_user_code
from gpukit.accelerators import Accelerator, auto_device_type, get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.memory._live import live_tensor_bytes
from gpukit.monitor import emit
from gpukit.memory._survivors import Container, FrameScan, find_stale_history, scan_user_frames, tag_roots

__all__ = ["MemoryLeakWarning", "LeakFinding", "LeakWatcher", "watch"]


class MemoryLeakWarning(UserWarning):
    """Memory grows across steps, or something keeps autograd graphs alive."""


LeakKind = Literal["autograd_history", "growing_container", "memory_growth"]


@dataclass(frozen=True)
class LeakFinding:
    """One diagnosed leak.

    Attributes:
        kind: ``"autograd_history"`` (a tensor keeps past steps' graphs), ``"growing_container"``
            (a list/dict of tensors grows every step) or ``"memory_growth"`` (memory rises
            steadily; ``cause`` names the likely holder when one was found).
        step: the step at which it was detected.
        variable: the variable holding it, e.g. ``"total_loss"`` or ``"outputs"``.
        location: ``"train() at train.py:42"``: the frame that holds the variable.
        growth_bytes_per_step: robust slope of memory per step (``memory_growth`` only).
        fix: what to change.
        message: the full sentence that is warned.
    """

    kind: LeakKind
    step: int
    variable: str | None
    location: str | None
    growth_bytes_per_step: float | None
    fix: str
    message: str


def _theil_sen_slope(points: list[tuple[int, int]]) -> float:
    """Median of pairwise slopes: one outlier sample cannot fake or hide a trend."""
    slopes = [(b2 - b1) / (s2 - s1) for i, (s1, b1) in enumerate(points) for s2, b2 in points[i + 1 :] if s2 != s1]
    return statistics.median(slopes) if slopes else 0.0


class LeakWatcher:
    """Detects steadily growing memory across training steps and names the likely cause.

    Args:
        every_n_steps: steps between checks. At the default (10) the ``total_loss += loss``
            pattern is named by step 20.
        device: device whose memory is sampled; the best available device type by default.
        warn: emit a :class:`MemoryLeakWarning` for each new finding.
        window: memory samples compared by the growth test (at least 4).
        min_growth_bytes: growth across a window below this is never a leak.
        min_growth_fraction: ...nor growth below this fraction of the first sample.
        max_overhead: fraction of step time the CPU heap walk may use (default 0.5%, so walk
            plus checks stay under 1%); ``None`` walks at every
            check (tests, short diagnostic runs).
        on_leak: called with each new :class:`LeakFinding`.

    Raises:
        ConfigurationError: for a non-positive interval, a window below 4 or a bad device.
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        *,
        device: str | torch.device | None = None,
        warn: bool = True,
        window: int = 8,
        min_growth_bytes: int = 1 * MIB,
        min_growth_fraction: float = 0.01,
        max_overhead: float | None = 0.005,
        on_leak: Callable[[LeakFinding], None] | None = None,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ConfigurationError(f"every_n_steps={every_n_steps!r}: expected an int >= 1 (default 10).")
        if window < 4:
            raise ConfigurationError(f"window={window!r}: the growth test needs at least 4 samples.")
        if max_overhead is not None and not 0 < max_overhead <= 1:
            raise ConfigurationError(f"max_overhead={max_overhead!r}: expected a fraction in (0, 1], e.g. 0.01.")
        self.every_n_steps = every_n_steps
        self.device = torch.device(device if device is not None else auto_device_type())
        self.accelerator: Accelerator = get_accelerator(self.device)
        self.warn = warn
        self.window = window
        self.min_growth_bytes = min_growth_bytes
        self.min_growth_fraction = min_growth_fraction
        self.max_overhead = max_overhead
        self.on_leak = on_leak
        self.findings: list[LeakFinding] = []
        #: ``(step, bytes)`` memory samples, newest last
        self.samples: list[tuple[int, int]] = []
        self.steps = 0
        self.checks = 0
        self._reported: set[tuple[str, str]] = set()
        self._lengths: dict[str, list[int]] = {}
        self._step_time_s = 0.0
        self._typical_step_s: float | None = None
        self._last_step_at: float | None = None
        self._heap_walk_cost_s = 0.0
        #: seconds spent inside checks so far: the watcher's own cost, measured directly
        self.time_in_checks_s = 0.0
        self._hook_handles: list[Any] = []

    # -- driving ---------------------------------------------------------------------------
    def step(self) -> list[LeakFinding]:
        """Count one step; every ``every_n_steps`` run a check.

        Returns:
            Findings new at this step (usually empty).
        """
        now = time.perf_counter()
        if self._last_step_at is not None:
            gap = now - self._last_step_at
            # a pause between steps (evaluation, checkpointing) is not step time: clip it to a
            # few typical steps so the heap-walk budget stays a fraction of training work
            typical = self._typical_step_s or gap
            self._step_time_s += min(gap, 3 * typical)
            self._typical_step_s = 0.9 * typical + 0.1 * min(gap, 3 * typical)
        self._last_step_at = now
        self.steps += 1
        if self.steps % self.every_n_steps:
            return []
        return self._check(sys._getframe(1))

    def check(self) -> list[LeakFinding]:
        """Run a check now, whatever the step count."""
        return self._check(sys._getframe(1))

    def attach(self, optimizer: torch.optim.Optimizer) -> LeakWatcher:
        """Call :meth:`step` after every ``optimizer.step()`` (hook form); undo with :meth:`detach`."""
        self._hook_handles.append(optimizer.register_step_post_hook(lambda *_: self.step()))
        return self

    def detach(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # -- the check -------------------------------------------------------------------------
    def _check(self, frame: Any) -> list[LeakFinding]:
        started = time.perf_counter()
        try:
            return self._check_now(frame)
        finally:
            self.time_in_checks_s += time.perf_counter() - started

    def _check_now(self, frame: Any) -> list[LeakFinding]:
        self.checks += 1
        scan = scan_user_frames(frame)
        new = self._graph_history(scan) + self._growing_containers(scan)
        sample = self._sample_memory()
        if sample is not None:
            self.samples.append((self.steps, sample))
            del self.samples[: -4 * self.window]
            new += self._memory_growth(scan)
        tag_roots(scan.survivors, self.checks)
        del scan
        for finding in new:
            self.findings.append(finding)
            emit("leak_warning", message=finding.message)
            if self.warn:
                warn_at_user_code(MemoryLeakWarning(finding.message))
            if self.on_leak is not None:
                self.on_leak(finding)
        return new

    def _report(self, key: tuple[str, str], finding: LeakFinding) -> list[LeakFinding]:
        if key in self._reported:
            return []
        self._reported.add(key)
        return [finding]

    def _graph_history(self, scan: FrameScan) -> list[LeakFinding]:
        found = []
        for survivor, tagged_at, nodes in find_stale_history(scan.survivors, self.checks):
            steps_held = (self.checks - tagged_at) * self.every_n_steps
            scalar = survivor.tensor.numel() == 1
            fix = (
                f"accumulate a number: `{survivor.name} += loss.item()`" if scalar else f"store `.detach()`ed tensors in `{survivor.name}`"
            ) + ", or compute it under `torch.no_grad()`"
            message = (
                f"`{survivor.name}` ({survivor.location}) keeps the autograd graph of past steps alive "
                f"(history spans at least {steps_held} steps, {nodes}+ graph nodes): memory grows every step. "
                f"Fix: {fix}."
            )
            found += self._report(
                ("autograd_history", f"{survivor.location}|{survivor.name}"),
                LeakFinding("autograd_history", self.steps, survivor.name, survivor.location, None, fix, message),
            )
        return found

    def _growing_containers(self, scan: FrameScan) -> list[LeakFinding]:
        found = []
        for key, container in scan.containers.items():
            lengths = self._lengths.setdefault(key, [])
            lengths.append(container.length)
            del lengths[:-3]
            growing = len(lengths) == 3 and lengths[0] < lengths[1] < lengths[2]
            # detached CPU tensors in a list are often intended (predictions for a metric);
            # they are named only when memory also grows (see _memory_growth)
            if growing and (container.holds_graph or container.device_type != "cpu"):
                found += self._container_finding(container)
        for key in set(self._lengths) - set(scan.containers):
            del self._lengths[key]
        return found

    def _container_finding(self, container: Container, growth: float | None = None) -> list[LeakFinding]:
        what = "tensors with their autograd graphs" if container.holds_graph else f"{container.device_type} tensors"
        fix = (
            f"append `out.detach()` (or `loss.item()` for scalars) to `{container.name}`"
            if container.holds_graph
            else f"append `.item()`/`.cpu()` values, or `del`/clear `{container.name}` when done"
        )
        message = (
            f"`{container.name}` ({container.location}) grows every step (now {container.length} items) "
            f"and holds {what}. Fix: {fix}."
        )
        return self._report(
            ("growing_container", f"{container.location}|{container.name}"),
            LeakFinding("growing_container", self.steps, container.name, container.location, growth, fix, message),
        )

    def _sample_memory(self) -> int | None:
        if self.accelerator.type != "cpu":
            return self.accelerator.memory_stats(self.device).get("allocated_bytes")
        # The heap walk is the costly part of a CPU check: run it only when the time spent in
        # steps since the last walk pays for it at the allowed overhead.
        if self.samples and self.max_overhead is not None and self._step_time_s * self.max_overhead < self._heap_walk_cost_s:
            return None
        started = time.perf_counter()
        value = live_tensor_bytes("cpu")
        self._heap_walk_cost_s = time.perf_counter() - started
        self._step_time_s = 0.0
        return value

    def _memory_growth(self, scan: FrameScan) -> list[LeakFinding]:
        points = self.samples[-self.window :]
        if len(points) < self.window:
            return []
        half = self.window // 2
        early, late = [b for _, b in points[:half]], [b for _, b in points[half:]]
        growth = statistics.median(late) - statistics.median(early)
        threshold = max(self.min_growth_bytes, self.min_growth_fraction * points[0][1])
        if min(late) <= max(early) or growth < threshold:
            return []
        slope = _theil_sen_slope(points)
        grown = [c for c in scan.containers.values() if len(self._lengths.get(f"{c.location}|{c.name}", [])) >= 2]
        growing = [c for c in grown if self._lengths[f"{c.location}|{c.name}"][-2] < c.length]
        cause = (
            f" Likely cause: `{growing[0].name}` ({growing[0].location}) grows every step ({growing[0].length} items)."
            if growing
            else " No growing variable was found in the calling frames; look for lists, dicts or caches "
            "of tensors kept on objects or globals (`gpukit.memory.memory_report()` shows the totals)."
        )
        fix = "keep `.item()` values or `.detach().cpu()` copies, `del` what is no longer needed, and run inference under `torch.no_grad()`"
        message = (
            f"{self.device.type} memory grew steadily by {format_bytes(growth)} over steps {points[0][0]}-{points[-1][0]} "
            f"(about {format_bytes(slope)} per step).{cause} Fix: {fix}."
        )
        return self._report(
            ("memory_growth", growing[0].name if growing else ""),
            LeakFinding("memory_growth", self.steps, growing[0].name if growing else None,
                        growing[0].location if growing else None, slope, fix, message),
        )


def watch(every_n_steps: int = 10, **options: Any) -> LeakWatcher:
    """Shorthand for :class:`LeakWatcher` (``watcher = gpukit.memory.watch(); ... watcher.step()``)."""
    return LeakWatcher(every_n_steps, **options)
