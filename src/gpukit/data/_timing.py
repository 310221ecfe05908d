"""Step-time breakdown: where each training step's time goes, measured in the real run.

Every batch a gpukit loader hands out opens a *step* that ends when the next batch is asked
for (or the pass over the loader ends). A step's time splits into

* ``data_wait_s``: waiting for the loader to produce the batch (``next()`` on the DataLoader);
* ``h2d_s``: the host-to-device copy of the batch (``None`` where there is no copy: training
  on the host, or a GPU copy whose CUDA events are not done yet in lazy mode);
* ``compute_s``: the rest -- the user's forward, backward and optimizer step, up to the next
  request for data (``step_time_s - data_wait_s - (h2d_s or 0)``).

On a GPU the default is lazy: the copy is bracketed by two CUDA events that are read only if
the GPU already passed them when the step completes, so no synchronisation is added to the
loop. ``StepTimings.exact = True`` synchronises at each step boundary instead, for exact
figures at the price of the overlap between host and GPU. On the host every figure is exact.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpukit._util.envvars import EXACT_TIMING_ENV
from gpukit.accelerators import Accelerator
from gpukit.monitor import Throughput

__all__ = ["StepTiming", "StepTimings", "TimingSummary", "PassTotals", "timed_progress"]

#: the progress bar shows ``data NN%`` from this data-wait share on
DATA_SHARE_SHOWN = 0.10
_EMA = 0.1  # weight of the newest step in the progress bar's moving averages


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One completed step, as handed to ``StepTimings`` listeners.

    Attributes:
        step: 0-based count of batches drawn from this session's gpukit loaders.
        epoch: the loader's epoch the batch belongs to.
        rank: the process's rank.
        samples: items in the batch (0 when the batch holds no tensor with a batch dimension).
        step_time_s: from the request of this batch to the request of the next one.
        data_wait_s: time the request waited for the loader.
        h2d_s: host-to-device copy; ``None`` where not measured (no copy, or lazy CUDA events
            not complete yet).
        compute_s: the rest of the step.
        exact: whether the figures are exact (host device, or GPU timings synchronised).
    """

    step: int
    epoch: int
    rank: int
    samples: int
    step_time_s: float
    data_wait_s: float
    h2d_s: float | None
    compute_s: float
    exact: bool


class PassTotals:
    """Sums over the steps of one pass over a loader (one epoch) on this rank."""

    __slots__ = ("epoch", "steps", "samples", "step_s", "wait_s", "h2d_s", "h2d_steps",
                 "share_sum", "share_sq", "first_wait_s")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.steps = self.samples = self.h2d_steps = 0
        self.step_s = self.wait_s = self.h2d_s = self.share_sum = self.share_sq = 0.0
        self.first_wait_s = 0.0

    def add(self, samples: int, step_s: float, wait_s: float, h2d_s: float | None) -> None:
        if not self.steps:
            self.first_wait_s = wait_s
        self.steps += 1
        self.samples += samples
        self.step_s += step_s
        self.wait_s += wait_s
        if h2d_s is not None:
            self.h2d_s += h2d_s
            self.h2d_steps += 1
        share = wait_s / step_s if step_s > 0 else 0.0
        self.share_sum += share
        self.share_sq += share * share

    def merge(self, other: PassTotals) -> None:
        for name in ("steps", "samples", "step_s", "wait_s", "h2d_s", "h2d_steps",
                     "share_sum", "share_sq"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_list(self) -> list[float]:
        """The figures the end-of-epoch report gathers from every rank."""
        return [float(v) for v in (self.steps, self.samples, self.step_s, self.wait_s, self.h2d_s,
                                   self.h2d_steps, self.first_wait_s, self.share_sum, self.share_sq)]

    @classmethod
    def from_list(cls, values: list[float], epoch: int) -> PassTotals:
        t = cls(epoch)
        t.steps, t.samples, t.h2d_steps = int(values[0]), int(values[1]), int(values[5])
        t.step_s, t.wait_s, t.h2d_s, t.first_wait_s = values[2], values[3], values[4], values[6]
        t.share_sum, t.share_sq = values[7], values[8]
        return t

    def summary(self, busy_s: float | None = None, steady: Throughput | None = None) -> TimingSummary:
        n = self.steps
        mean = self.share_sum / n if n else 0.0
        std = math.sqrt(max(0.0, self.share_sq / n - mean * mean)) if n else 0.0
        total = self.step_s
        # an unmeasured copy (lazy CUDA events not done) counts as its measured steps' mean
        h2d = self.h2d_s / self.h2d_steps * n if self.h2d_steps else None
        rate = lambda count: count / total if total > 0 else None  # noqa: E731
        return TimingSummary(
            steps=n, samples=self.samples, step_time_s=total, data_wait_s=self.wait_s,
            h2d_s=h2d, compute_s=max(0.0, total - self.wait_s - (h2d or 0.0)),
            samples_per_s=steady.samples_per_s if steady and steady.steps else rate(self.samples),
            steps_per_s=steady.steps_per_s if steady and steady.steps else rate(n),
            data_share=self.wait_s / total if total > 0 else 0.0, data_share_std=std,
            h2d_share=(h2d / total if total > 0 else 0.0) if h2d is not None else None,
        )


@dataclass(frozen=True)
class TimingSummary:
    """Steps summed: totals, rates and shares of the step time.

    ``data_share`` is total data wait / total step time; ``data_share_std`` is the spread of
    the per-step share (a loader that stalls now and then has a large spread).
    """

    steps: int
    samples: int
    step_time_s: float
    data_wait_s: float
    h2d_s: float | None
    compute_s: float
    samples_per_s: float | None
    steps_per_s: float | None
    data_share: float
    data_share_std: float
    h2d_share: float | None

    @property
    def compute_share(self) -> float:
        return self.compute_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def __str__(self) -> str:
        rate = f"{self.samples_per_s:.1f} samples/s, " if self.samples_per_s else ""
        copy = f", copy {self.h2d_share:.0%}" if self.h2d_share is not None else ""
        ms = 1e3 * self.step_time_s / self.steps if self.steps else 0.0
        return (f"{rate}{ms:.2f} ms/step: data {self.data_share:.0%} "
                f"(+-{self.data_share_std:.0%}){copy}, compute {self.compute_share:.0%}")


class StepTimings:
    """The session's step-time breakdown (``session.timings``): every gpukit loader reports here.

    Args:
        accelerator: the device's accelerator (CUDA events for the copy on GPUs).
        rank: this process's rank (stamped on each :class:`StepTiming`).
        exact: synchronise the GPU at step boundaries (``GPUKIT_EXACT_TIMING=1`` also sets it).
        report: print the end-of-epoch diagnosis line (rank 0 only) to stderr.
        warmup_steps: steps left out of :meth:`throughput` rates (start-up costs).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        rank: int = 0,
        exact: bool = False,
        report: bool = False,
        warmup_steps: int = 1,
    ) -> None:
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        self.rank = rank
        self.exact = exact or os.environ.get(EXACT_TIMING_ENV) == "1"
        self.report = report
        self._listeners: list[Callable[[StepTiming], Any]] = []
        self._next_step = 0
        self._busy_s = 0.0  # summed step time: the clock of the steady-state meter
        self._meter = Throughput(warmup_steps, clock=lambda: self._busy_s)
        self._done = PassTotals()
        self._active: list[PassTotals] = []
        self.recent_step_s: float | None = None  # moving averages for the progress bar
        self.recent_data_share: float | None = None
        self._recent_samples = 0.0
        #: end-of-epoch reports so far (:class:`gpukit.data.EpochReport`), newest last
        self.epoch_reports: list[Any] = []
        #: ``note(report) -> str | None`` each: text added to every epoch's line (the session's MFU)
        self.epoch_notes: list[Callable[[Any], str | None]] = []

    # -- listeners ------------------------------------------------------------------------------
    def add_listener(self, callback: Callable[[StepTiming], Any]) -> None:
        """Call ``callback(StepTiming)`` once per completed step, in the training thread.

        Keep it cheap: it runs inside the loop. A callback that raises stops the loop.
        """
        if not callable(callback):
            from gpukit.errors import ConfigurationError

            raise ConfigurationError(
                f"add_listener got {type(callback).__name__}, not a callable; pass a function "
                "taking one StepTiming."
            )
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[StepTiming], Any]) -> None:
        """Stop calling ``callback`` (no error if it was not registered)."""
        if callback in self._listeners:
            self._listeners.remove(callback)

    # -- results -------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps completed so far."""
        return self._next_step

    def throughput(self) -> TimingSummary:
        """Everything so far: samples/s and steps/s (after warm-up), data-wait share and spread."""
        total = PassTotals()
        total.merge(self._done)
        for running in self._active:
            total.merge(running)
        return total.summary(steady=self._meter)

    def status_text(self) -> str:
        """What the progress bar shows: ``812 samples/s``, plus ``data 37%`` when high."""
        if not self.recent_step_s:
            return ""
        text = f"{self._recent_samples / self.recent_step_s:,.0f} samples/s"
        if self.recent_data_share is not None and self.recent_data_share >= DATA_SHARE_SHOWN:
            text += f"  data {self.recent_data_share:.0%}"
        return text

    # -- the timed loop ------------------------------------------------------------------------
    def iterate(
        self,
        batches: Iterable[Any],
        *,
        epoch: int,
        move: Callable[[Any], Any] | None = None,
        fetch: Callable[[Iterator[Any]], Any] = next,
        on_pass_end: Callable[[PassTotals], None] | None = None,
    ) -> Iterator[Any]:
        """Yield ``batches`` (moved by ``move``) timing every step; see the module docstring.

        ``fetch(batches)`` draws one batch (a loader adds its stall guard there).
        ``on_pass_end(totals)`` runs when ``batches`` is exhausted (not when the loop breaks).
        """
        from gpukit.memory import batch_length

        batches = iter(batches)
        clock = time.perf_counter
        accelerator = self.accelerator
        synced = self.exact and not accelerator.is_host
        exact = accelerator.is_host or synced
        # lazy GPU mode: events around the copy (None where the backend has no timing events)
        lazy = not exact and move is not None and accelerator.timing_event() is not None
        totals = PassTotals(epoch)
        self._active.append(totals)
        pending: tuple | None = None
        try:
            while True:
                if synced:
                    accelerator.synchronize()
                t_req = clock()
                if pending is not None:
                    self._complete(totals, pending, t_req, exact)
                    pending = None
                try:
                    batch = fetch(batches)
                except StopIteration:
                    break
                t_got = clock()
                try:
                    samples = batch_length(batch)
                except Exception:  # noqa: BLE001 - no tensor with a batch dim: count unknown
                    samples = 0
                h2d: Any = None
                if move is not None:
                    if lazy:
                        start = accelerator.timing_event()
                        start.record()
                    batch = move(batch)
                    if lazy:
                        h2d = _EventPair(start, accelerator.timing_event())
                        h2d.end.record()
                    elif synced:
                        accelerator.synchronize()
                        h2d = clock() - t_got
                    elif not accelerator.is_host:
                        h2d = clock() - t_got
                pending = (t_req, t_got, samples, h2d, totals.epoch)
                yield batch
                # hold no reference while the next batch is made: the training loop's own
                # variable is the only one, as with a plain DataLoader (measured: a second
                # holder costs ~4 us a batch in allocator traffic for 200 KiB batches)
                del batch
            if on_pass_end is not None:
                self._active.remove(totals)
                self._done.merge(totals)
                on_pass_end(totals)
        finally:
            if pending is not None:  # the loop broke: the last step ends now
                self._complete(totals, pending, clock(), exact)
            if totals in self._active:
                self._active.remove(totals)
                self._done.merge(totals)

    def _complete(self, totals: PassTotals, pending: tuple, t_end: float, exact: bool) -> None:
        t_req, t_got, samples, h2d, epoch = pending
        if isinstance(h2d, _EventPair):
            h2d = h2d.elapsed_s()
        step_s = t_end - t_req
        wait_s = t_got - t_req
        totals.add(samples, step_s, wait_s, h2d)
        self._busy_s += step_s
        self._meter.update(samples)
        if self.recent_step_s is None:
            self.recent_step_s, self._recent_samples = step_s, float(samples)
            self.recent_data_share = wait_s / step_s if step_s > 0 else 0.0
        else:
            self.recent_step_s += _EMA * (step_s - self.recent_step_s)
            self._recent_samples += _EMA * (samples - self._recent_samples)
            share = wait_s / step_s if step_s > 0 else 0.0
            self.recent_data_share += _EMA * (share - self.recent_data_share)  # type: ignore[operator]
        step = self._next_step
        self._next_step = step + 1
        if self._listeners:
            record = StepTiming(
                step=step, epoch=epoch, rank=self.rank, samples=samples, step_time_s=step_s,
                data_wait_s=wait_s, h2d_s=h2d,
                compute_s=max(0.0, step_s - wait_s - (h2d or 0.0)), exact=exact,
            )
            for listener in tuple(self._listeners):
                listener(record)

    def gather_pass(self, totals: PassTotals, gather: Any) -> list[PassTotals]:
        """Every rank's totals of this pass on rank 0 (an :class:`EpochGather` of the loader);
        this rank's alone elsewhere, or when a rank did not end the pass in time."""
        if gather is None:
            return [totals]
        rows = gather.gather(totals.as_list(), totals.epoch)
        if rows is None or len(rows) == 1:
            return [totals]
        return [PassTotals.from_list(row, totals.epoch) for row in rows]

    def record_epoch(self, report: Any) -> None:
        """Keep an :class:`~gpukit.data.EpochReport` (its line with the :attr:`epoch_notes`); print
        the line on rank 0 when reporting."""
        notes = [text for text in (note(report) for note in self.epoch_notes) if text]
        if notes:
            from dataclasses import replace

            report = replace(report, line=f"{report.line}; " + "; ".join(notes))
        self.epoch_reports.append(report)
        del self.epoch_reports[:-100]
        if self.report and self.rank == 0:
            print(report.line, file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        return f"StepTimings(steps={self._next_step}, exact={self.exact}, rank={self.rank})"


class _EventPair:
    """Two CUDA events around a copy, read without waiting (``None`` until the GPU passed them)."""

    __slots__ = ("start", "end")

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def elapsed_s(self) -> float | None:
        if not self.end.query():  # the GPU has not reached the end of the copy yet
            return None
        return self.start.elapsed_time(self.end) / 1e3


def timed_progress(
    iterable: Any,
    timings: StepTimings,
    *,
    total: int | None = None,
    description: str = "",
    enabled: bool = True,
) -> Iterator[Any]:
    """``Session.progress``: the live bar with samples/s and the data share; a plain torch
    DataLoader is timed too (a gpukit loader already is)."""
    from torch.utils.data import DataLoader

    from gpukit._util.progress import progress

    if total is None:
        try:
            total = len(iterable)
        except TypeError:
            total = None
    if isinstance(iterable, DataLoader):
        epoch = int(getattr(iterable.sampler, "epoch", 0) or 0)
        iterable = timings.iterate(iterable, epoch=epoch)
    return progress(iterable, total=total, description=description, enabled=enabled,
                    status=timings.status_text)
