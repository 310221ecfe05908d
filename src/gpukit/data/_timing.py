"""Step-time breakdown: where each training step's time goes, measured in the real run.

Every batch a gpukit loader hands out opens a *step* that ends when the next batch is asked
for (or the pass over the loader ends). A step's time splits into

* ``data_wait_s``: waiting for the loader to produce the batch (``next()`` on the DataLoader);
* ``h2d_s``: the host-to-device copy of the batch (``None`` where there is no copy: training
  on the host, or a step whose copy was not sampled);
* ``compute_s``: the rest -- the user's forward, backward and optimizer step, up to the next
  request for data (``step_time_s - data_wait_s - (h2d_s or 0)``).

**Nothing the GPU waits for.** Every step costs two clock reads and a few additions: the data
wait and the step time are exact on every step. The copy is timed on *sampled* steps only --
the first :data:`SAMPLE_FIRST` of each pass and then one in :data:`SAMPLE_EVERY` -- with two
device events read when the step completes, never waited for (a copy the GPU has not finished
by then is left unmeasured). Steps in between issue no synchronisation and no device event, and
make no Python object (except a :class:`StepTiming` per step for listeners, when there are
any). The copy's share is the sampled copies' mean times the steps, with its sampling error
(``TimingSummary.h2d_share_err``: 1.96 standard errors of the sampled mean, about a 95% interval).
``StepTimings.exact = True`` (``GPUKIT_EXACT_TIMING=1``) synchronises around the sampled steps
instead, for exact copy figures at the price of the overlap there. On the host every figure is exact.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any

from gpukit._util.envvars import EXACT_TIMING_ENV
from gpukit.accelerators import Accelerator
from gpukit.data._pass_totals import PassTotals, StepTiming, TimingSummary, count_step

__all__ = ["SAMPLE_EVERY", "SAMPLE_FIRST", "StepTiming", "StepTimings", "TimingSummary", "PassTotals",
           "timed_progress"]

#: the progress bar shows ``data NN%`` from this data-wait share on
DATA_SHARE_SHOWN = 0.10
_EMA_KEEP = 0.9  # per step: the progress bar's moving averages keep this much of their value
#: one step in this many has its copy timed (and feeds the progress bar's averages)
SAMPLE_EVERY = 16
#: the first steps of every pass are all sampled (the start of an epoch is where loaders differ)
SAMPLE_FIRST = 3


class StepTimings:
    """The session's step-time breakdown (``session.timings``): every gpukit loader reports here.

    Args:
        accelerator: the device's accelerator (device events time the sampled copies).
        rank: this process's rank (stamped on each :class:`StepTiming`).
        exact: synchronise the GPU around sampled steps (``GPUKIT_EXACT_TIMING=1`` also sets it).
        report: print the end-of-epoch diagnosis line (rank 0 only) to stderr.
        warmup_steps: steps left out of :meth:`throughput` rates (start-up costs).
        sample_every: time the copy of one step in this many (and the first ``sample_first``
            of each pass); 1 times every step.
        sample_first: steps sampled at the start of every pass.

    Raises:
        ConfigurationError: ``sample_every`` < 1 or ``sample_first`` < 0.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        *,
        rank: int = 0,
        exact: bool = False,
        report: bool = False,
        warmup_steps: int = 1,
        sample_every: int = SAMPLE_EVERY,
        sample_first: int = SAMPLE_FIRST,
    ) -> None:
        for name, value, least in (("sample_every", sample_every, 1), ("sample_first", sample_first, 0),
                                   ("warmup_steps", warmup_steps, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                from gpukit.errors import ConfigurationError

                raise ConfigurationError(f"StepTimings({name}={value!r}): use an int >= {least}.")
        self.accelerator = accelerator if accelerator is not None else Accelerator()
        self.rank = rank
        self.exact = exact or os.environ.get(EXACT_TIMING_ENV) == "1"
        self.report = report
        self.warmup_steps = warmup_steps
        self.sample_every = sample_every
        self.sample_first = sample_first
        self._listeners: list[Callable[[StepTiming], Any]] = []
        self._next_step = 0
        # (steps, samples, step seconds) when warm-up ended: the steady rates count from there
        self._warm: tuple[int, int, float] | None = (0, 0, 0.0) if warmup_steps == 0 else None
        self._done = PassTotals()
        self._active: list[PassTotals] = []
        # moving averages for the progress bar, over every step, brought up to date at sampled steps
        self.recent_step_s: float | None = None
        self.recent_data_share: float | None = None
        self._recent_samples = 0.0
        #: end-of-epoch reports so far (:class:`gpukit.data.EpochReport`), newest last
        self.epoch_reports: list[Any] = []
        #: ``note(report) -> str | None`` each: text added to every epoch's line (the session's MFU)
        self.epoch_notes: list[Callable[[Any], str | None]] = []
        #: ``() -> bool``: whether the pass that just ended trained (the session's); its line is printed only
        #: then -- an evaluation loader's pass is kept in ``epoch_reports`` but prints no epoch line
        self.shows_pass: Callable[[], bool] | None = None

    # -- listeners ------------------------------------------------------------------------------
    def add_listener(self, callback: Callable[[StepTiming], Any]) -> None:
        """Call ``callback(StepTiming)`` once per completed step, in the training thread.

        Keep it cheap: it runs inside the loop (and makes the loop build a StepTiming per
        step). A callback that raises stops the loop.
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

    def _all(self) -> PassTotals:
        total = PassTotals()
        total.merge(self._done)
        for running in self._active:
            total.merge(running)
        return total

    def throughput(self) -> TimingSummary:
        """Everything so far: samples/s and steps/s (after warm-up), data-wait share and spread,
        the copy's share with its sampling error."""
        total = self._all()
        steady = None
        if self._warm is not None:
            steps, samples, busy_s = self._warm
            steady = (total.steps - steps, total.samples - samples, total.step_s - busy_s)
        return total.summary(steady=steady)

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
        device: torch.device | None = None,
    ) -> Iterator[Any]:
        """Yield ``batches`` (moved by ``move``) timing every step; see the module docstring.

        ``device``: where ``move`` copies to. A sampled copy's events are recorded with it current
        (the copy runs on its stream; an event on another device's would pass before the copy ran,
        and a pinned buffer it fences would be reused while still read).

        ``fetch(batches)`` draws one batch (a loader adds its stall guard there).
        ``on_pass_end(totals)`` runs when ``batches`` is exhausted (not when the loop breaks).
        ``move.fence(event)``, where ``move`` has it, is given the event recorded after each
        sampled copy (the pinned pool reuses buffers the device has finished reading).
        """
        from torch import Tensor as tensor_type

        from gpukit.memory import batch_length

        batches = iter(batches)
        clock = time.perf_counter
        accelerator = self.accelerator
        on_device = not accelerator.is_host
        synced = self.exact and on_device
        exact = not on_device or synced
        fence = getattr(move, "fence", None)
        every, first = self.sample_every, self.sample_first
        totals = PassTotals(epoch)
        self._active.append(totals)
        i = 0  # steps of this pass handed out
        t_req = wait_s = 0.0
        samples = 0
        h2d: Any = None  # the open step's copy: seconds, an event pair, or None
        sampled = False
        open_step = False
        try:
            while True:
                # the step being completed, and whether the next one is sampled
                sampling = i < first or i % every == 0
                if synced and (sampled or sampling):
                    accelerator.synchronize()  # counted: exact mode pays for its figures
                t_next = clock()
                if open_step:
                    open_step = False
                    step_s = t_next - t_req
                    count_step(totals, samples, step_s, wait_s)  # a plain function: no attribute lookup
                    if sampled or self._listeners or self._next_step == self.warmup_steps - 1:
                        self._complete(totals, samples, step_s, wait_s, h2d, sampled, exact)
                    else:
                        self._next_step += 1
                sampled = sampling
                t_req = t_next
                try:
                    batch = fetch(batches)
                except StopIteration:
                    break
                t_got = clock()
                wait_s = t_got - t_req
                # the usual batch, (inputs, targets) with a batch dim, without a call; else batch_length
                head = batch[0] if (type(batch) is tuple or type(batch) is list) and batch else batch
                if type(head) is tensor_type and head.ndim:
                    samples = head.shape[0]
                else:
                    try:
                        samples = batch_length(batch)
                    except Exception:  # noqa: BLE001 - no tensor with a batch dim: count unknown
                        samples = 0
                h2d = None
                if move is not None:
                    if not (sampled and on_device):
                        batch = move(batch)
                    elif synced:
                        batch = move(batch)
                        accelerator.synchronize(device)
                        h2d = clock() - t_got
                    else:
                        with accelerator.device_scope(device) if device is not None else nullcontext():
                            start = accelerator.timing_event()
                            batch = move(batch)
                            end = accelerator.timing_event() if start is not None else None
                        if start is None:  # no device events: the host's time to issue the copy
                            h2d = clock() - t_got
                        else:
                            h2d = (start, end)
                            if fence is not None:
                                fence(end)
                i += 1
                open_step = True
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
            if open_step:  # the loop broke: the last step ends now
                step_s = clock() - t_req
                count_step(totals, samples, step_s, wait_s)
                self._complete(totals, samples, step_s, wait_s, h2d, sampled, exact)
            if totals in self._active:
                self._active.remove(totals)
                self._done.merge(totals)
            self._update_recent(totals)  # the steps since the last sampled one

    def _complete(self, totals: PassTotals, samples: int, step_s: float, wait_s: float, h2d: Any,
                  sampled: bool, exact: bool) -> None:
        """The rarer part of a step's end (counted already): a sampled step's copy time and
        averages, the end of warm-up, the listeners' StepTiming."""
        if type(h2d) is tuple:
            start, end = h2d
            accelerator = self.accelerator
            h2d = accelerator.elapsed_s(start, end) if accelerator.event_done(end) else None
        if sampled:
            totals.add_sample(step_s, wait_s, h2d)
            self._update_recent(totals)
        step = self._next_step
        self._next_step = step + 1
        if self._warm is None and self._next_step >= self.warmup_steps:
            done = self._all()
            self._warm = (done.steps, done.samples, done.step_s)
        if self._listeners:
            record = StepTiming(
                step=step, epoch=totals.epoch, rank=self.rank, samples=samples, step_time_s=step_s,
                data_wait_s=wait_s, h2d_s=h2d,
                compute_s=max(0.0, step_s - wait_s - (h2d or 0.0)), exact=exact,
            )
            for listener in tuple(self._listeners):
                listener(record)

    def _update_recent(self, totals: PassTotals) -> None:
        """Fold the steps since the last update into the progress bar's averages: a window of
        ``n`` steps weighs as ``n`` steps of a per-step moving average would."""
        steps, samples, step_s, wait_s = totals.mark
        n = totals.steps - steps
        if n <= 0:
            return
        totals.mark = (totals.steps, totals.samples, totals.step_s, totals.wait_s)
        window_s = totals.step_s - step_s
        mean_s, mean_samples = window_s / n, (totals.samples - samples) / n
        share = (totals.wait_s - wait_s) / window_s if window_s > 0 else 0.0
        if self.recent_step_s is None or self.recent_data_share is None:
            self.recent_step_s, self._recent_samples, self.recent_data_share = mean_s, mean_samples, share
            return
        new = 1.0 - _EMA_KEEP ** n
        self.recent_step_s += new * (mean_s - self.recent_step_s)
        self._recent_samples += new * (mean_samples - self._recent_samples)
        self.recent_data_share += new * (share - self.recent_data_share)

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
        if self.report and self.rank == 0 and (self.shows_pass is None or self.shows_pass()):
            print(report.line, file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        return (f"StepTimings(steps={self._next_step}, exact={self.exact}, rank={self.rank}, "
                f"sample_every={self.sample_every})")


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
