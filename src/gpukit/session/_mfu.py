"""The session's MFU: FLOPs per step counted on the second training step, shown at each epoch's end, recorded.

Which step is counted: the SECOND training step, in a window that opens and closes inside gpukit's
own calls of that step, never across the user's code at large:

* a loop over a gpukit loader: from the moment the loader hands out the batch after the first
  ``session.step`` (with gradients on: an evaluation under ``torch.no_grad`` opens nothing) to the
  start of the next ``session.step`` -- the forward, the loss and the backward of that micro-batch,
  however the loop calls them; no optimizer step. A batch handed out before a step is taken (an
  evaluation batch), the end of the pass, or ``session.close()`` drops an open count (three
  dropped counts and it gives up: ``Session(flops_per_step=...)`` then);
* ``session.run_step``: the forward and backward inside the second call.

Not the first step: a ``torch.compile``'d model compiles in its first call, and a first call made
under torch's flop counter (a dispatch mode) is one Dynamo skips for good -- measured: the model
then never compiles. After the first step it is compiled, and counting it changes nothing (same
FLOPs, no recompilation). No hook on the model either: ``module.compile()`` compiles a module's
hooks with it, so a hook coming off recompiled the model. The counter slows that one step, which
its epoch's figures leave out; afterwards nothing is left but one attribute check in
``session.step`` and ``run_step``. ``Session(flops_per_step=N)`` skips the count.

Where it shows: each epoch of a gpukit loader ends with a line that now says the achieved TFLOP/s
and MFU (this rank's steps over their wall time, data waits included, as MFU is defined); the run
record gets an ``mfu`` event per epoch (``gpukit report`` sums them); ``session.mfu`` holds the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpukit.accelerators import Accelerator
from gpukit.monitor import (
    FlopWindow, MfuFigures, PeakChoice, check_flops_per_step, check_peak_tflops, matmul_dtype, mfu_figures,
    resolve_peak, tf32_matmuls_on,
)
from gpukit.strategies import Strategy

if TYPE_CHECKING:
    from gpukit.data import StepTimings
    from gpukit.session._loaders import LoaderTracker
    from gpukit.session._steps import TrainingSteps

__all__ = ["SessionMfu"]

#: counts that may be dropped (a pass ended, an evaluation batch) before the count gives up
MAX_RETRIES = 3

T = TypeVar("T")


class SessionMfu:
    """FLOPs per step and MFU of one session (see the module docstring).

    Args:
        peak_tflops: ``Session(peak_tflops=...)``: the device's dense peak, for devices the table lacks.
        flops_per_step: ``Session(flops_per_step=...)``: the model's own count (no counting then).
        strategy: the session's strategy (rank, device, precision: read when needed, as fit may change it).
        accelerator: the device's accelerator (its name comes from NVML through it).
        timings: the session's step timings, whose epoch lines get the MFU.
        loaders: the session's loader tracker (its ``on_batch`` opens the count).
        steps: the session's training steps (a pass with no ``session.step`` in it is no training pass).

    Raises:
        ConfigurationError: a bad ``peak_tflops`` or ``flops_per_step``.
    """

    def __init__(self, peak_tflops: Any, flops_per_step: Any, *, strategy: Strategy, accelerator: Accelerator,
                 timings: StepTimings, loaders: LoaderTracker, steps: TrainingSteps) -> None:
        self._given_peak = check_peak_tflops(peak_tflops)
        #: floating-point operations of one micro-batch's step on this process (``None``: not known yet)
        self.flops_per_step = check_flops_per_step(flops_per_step)
        #: ``"given"``, ``"counted"``, or why it is not known
        self.flops_source: str = "given" if self.flops_per_step is not None else "not counted yet"
        self._strategy = strategy
        self._accelerator = accelerator
        self._device_name: str | None = None
        self._named = False
        self._window = FlopWindow()
        self._pending = self.flops_per_step is None  # until the count is done or given up
        self._retries = 0
        self._steps_seen = 0
        self._loaders = loaders  # the session's LoaderTracker: tells of each batch handed out
        loaders.on_batch = self.on_batch if self._pending else None
        self._opened_s = 0.0
        self._steps = steps
        self._steps_at_last_pass = steps.micro_step
        #: wall time of the counted step, which the counter slowed: left out of its epoch's figures
        self._counted_s: float | None = None
        #: the run recorder, set by the session once it exists (``None``: not recording)
        self.recorder: Any = None
        #: the last epoch's figures (``None`` before one ends with a known FLOP count)
        self.last: MfuFigures | None = None
        timings.epoch_notes.append(self.epoch_note)

    # -- counting ------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether the FLOPs per step are still to be counted."""
        return self._pending

    def on_batch(self) -> None:
        """A gpukit loader hands out a batch: after the first step, the count opens (see the module docstring)."""
        import torch

        if self._window.is_open:
            self._drop("batches handed out without a session.step() between them")
        if self._pending and self._steps_seen and torch.is_grad_enabled():
            self._open()

    def before_step(self) -> None:
        """``session.step`` starts: it ends an open count (the first step opens nothing)."""
        if not self._pending:
            return
        if self._window.is_open:
            self._close()
        else:
            self._steps_seen += 1

    def count_run_step(self, run: Callable[[], T]) -> T:
        """``run()`` (a ``run_step``'s forward and backward), counted when it is the one to count."""
        opened = False
        if self._steps_seen and not self._window.is_open:
            self._open()
            opened = True
        try:
            out = run()
        except BaseException:
            if opened and self._window.is_open:
                self._drop("the step raised")
            raise
        if opened and self._window.is_open:
            self._close()
        return out

    def close(self) -> None:
        """The session closes: a count still open is dropped (the counter must not outlive the session)."""
        if self._window.is_open:
            self._window.close()
            self._finish("not counted: the session closed before a second step")

    def _open(self) -> None:
        self._opened_s = time.perf_counter()
        self._window.open()

    def _close(self) -> None:
        flops = self._window.close()
        self._counted_s = time.perf_counter() - self._opened_s
        if flops > 0:
            self.flops_per_step = flops
            self._finish("counted")
        else:
            self._finish("not counted: torch's flop counter saw no matrix products in the step; give "
                         "Session(flops_per_step=...)")

    def _drop(self, why: str) -> None:
        self._window.close()
        self._retries += 1
        if self._retries >= MAX_RETRIES:
            self._finish(f"not counted: {MAX_RETRIES} counts dropped (the last: {why}); give "
                         "Session(flops_per_step=...)")

    def _finish(self, source: str) -> None:
        self.flops_source = source
        self._pending = False
        self._loaders.on_batch = None  # nothing per batch from here on

    # -- figures -------------------------------------------------------------------------------
    def peak(self) -> PeakChoice:
        """The peak MFU divides by, for the precision that runs now (TF32 read each time: it may be switched)."""
        if not self._named:  # NVML's name of this device, once (None on the CPU)
            snapshot = self._accelerator.gpu_snapshot(self._strategy.root_device)
            self._device_name, self._named = (snapshot.name if snapshot is not None else None), True
        dtype = matmul_dtype(self._strategy.precision.name, tf32_matmuls_on())
        return resolve_peak(self._given_peak, self._device_name, dtype)

    def epoch_note(self, report: Any) -> str | None:
        """Achieved TFLOP/s and MFU of this rank's steps in an epoch (an :class:`~gpukit.data.EpochReport`)."""
        import torch

        if self._window.is_open:
            self._drop("a pass ended inside the count")
        stepped = self._steps.micro_step > self._steps_at_last_pass
        self._steps_at_last_pass = self._steps.micro_step
        # an evaluation pass (under no_grad, or no session.step since the last pass ended) has no
        # training FLOPs to rate
        if self.flops_per_step is None or not report.ranks or not stepped or not torch.is_grad_enabled():
            return None
        rank = self._strategy.rank if self._strategy.rank < len(report.ranks) else 0
        mine = report.ranks[rank]
        steps, seconds = mine.steps, mine.step_time_s
        if self._counted_s is not None and steps > 1 and seconds > self._counted_s:
            steps, seconds = steps - 1, seconds - self._counted_s  # the counted step's epoch: without it
        self._counted_s = None
        peak = self.peak()
        figures = mfu_figures(self.flops_per_step, steps, seconds, peak)
        if figures is None:
            return None
        self.last = figures
        if self.recorder is not None:
            self.recorder.on_event("mfu", time.time(), {
                "epoch": report.epoch, "steps": steps, "seconds": seconds,
                "flops_per_step": self.flops_per_step, "flops_source": self.flops_source, "dtype": peak.dtype,
                "peak_tflops": peak.tflops, "peak_source": peak.source[:200],
                "achieved_tflops": figures.achieved_tflops, "mfu": figures.mfu})
        return figures.text()
