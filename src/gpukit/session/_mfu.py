"""The session's MFU: FLOPs per step counted on the second training step, shown at each epoch's end, recorded.

Which step is counted: the SECOND training step -- from the end of the first
``session.step(optimizer)`` to the start of the second: fetching the batch, the forward, the
loss and the backward of one micro-batch on this process, however the loop calls them
(``run_step``, ``session.backward``, ``loss.backward()``); no optimizer step. Not the first: a
``torch.compile``'d model compiles in its first call, and a first call made under torch's flop
counter (a dispatch mode) is one Dynamo skips for good -- measured: the model then never compiles.
After the first step it is compiled, and counting it changes nothing (same FLOPs, no
recompilation). No hook on the model either: ``module.compile()`` compiles a module's hooks with
it, so a hook would recompile the model when it comes off. The counter slows that one step, which
its epoch's figures leave out; afterwards nothing is left but one attribute check in
``session.step``. An epoch that ends inside the counted step (a pass of one batch) drops the count
and tries again at the next step, up to three times. ``Session(flops_per_step=N)`` skips the count.

Where it shows: each epoch of a gpukit loader ends with a line that now says the achieved TFLOP/s
and MFU (this rank's steps over their wall time, data waits included, as MFU is defined); the run
record gets an ``mfu`` event per epoch (``gpukit report`` sums them); ``session.mfu`` holds the last.
"""

from __future__ import annotations

import time
from typing import Any

from gpukit.accelerators import Accelerator
from gpukit.monitor import (
    FlopWindow, MfuFigures, PeakChoice, check_flops_per_step, check_peak_tflops, matmul_dtype, mfu_figures,
    resolve_peak, tf32_matmuls_on,
)
from gpukit.strategies import Strategy

__all__ = ["SessionMfu"]

#: epochs that may end inside the counted step before the count gives up
MAX_RETRIES = 3


class SessionMfu:
    """FLOPs per step and MFU of one session (see the module docstring).

    Args:
        peak_tflops: ``Session(peak_tflops=...)``: the device's dense peak, for devices the table lacks.
        flops_per_step: ``Session(flops_per_step=...)``: the model's own count (no counting then).
        strategy: the session's strategy (rank, device, precision: read when needed, as fit may change it).
        accelerator: the device's accelerator (its name comes from NVML through it).
        timings: the session's step timings, whose epoch lines get the MFU.

    Raises:
        ConfigurationError: a bad ``peak_tflops`` or ``flops_per_step``.
    """

    def __init__(self, peak_tflops: Any, flops_per_step: Any, *, strategy: Strategy, accelerator: Accelerator,
                 timings: Any) -> None:
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
        self._opened_s = 0.0
        #: wall time of the counted step, which the counter slowed: left out of its epoch's figures
        self._counted_s: float | None = None
        #: the run recorder, set by the session once it exists (``None``: not recording)
        self.recorder: Any = None
        #: the last epoch's figures (``None`` before one ends with a known FLOP count)
        self.last: MfuFigures | None = None
        timings.epoch_notes.append(self.epoch_note)

    # -- counting ------------------------------------------------------------------------------
    def before_step(self) -> None:
        """``session.step`` starts: the second one ends the counted step (a no-op once counted)."""
        if not self._pending or not self._window.is_open:
            return
        flops = self._window.close()
        self._counted_s = time.perf_counter() - self._opened_s
        if flops > 0:
            self.flops_per_step = flops
            self._finish("counted")
        else:
            self._finish("not counted: torch's flop counter saw no matrix products in the step; give "
                         "Session(flops_per_step=...)")

    def after_step(self) -> None:
        """``session.step`` ended: the first one opens the count (a no-op once counted)."""
        if self._pending and not self._window.is_open:
            self._opened_s = time.perf_counter()
            self._window.open()

    def _finish(self, source: str) -> None:
        self.flops_source = source
        self._pending = False

    def close(self) -> None:
        """The session closes: a count still open is dropped (the counter must not outlive the session)."""
        if self._window.is_open:
            self._window.close()
            self._finish("not counted: the session closed before a second step")

    def _epoch_ended_mid_count(self) -> None:
        self._window.close()  # the batch that would end it belongs to the next epoch: count again from there
        self._retries += 1
        if self._retries >= MAX_RETRIES:
            self._finish(f"not counted: {MAX_RETRIES} epochs ended inside the counted step; give "
                         "Session(flops_per_step=...)")

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
        if self._window.is_open:
            self._epoch_ended_mid_count()
        if self.flops_per_step is None or not report.ranks:
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
