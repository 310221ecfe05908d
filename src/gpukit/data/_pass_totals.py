"""What the step timing adds up: one step (:class:`StepTiming`), a pass's running sums
(:class:`PassTotals`, gathered over ranks as a flat list) and their summary (:class:`TimingSummary`,
with the sampled copy share's error). How steps are measured is :mod:`gpukit.data._timing`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PassTotals", "StepTiming", "TimingSummary", "count_step"]

_Z95 = 1.96  # standard errors either side of a mean for a ~95% interval


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
        h2d_s: host-to-device copy; ``None`` where not measured (no copy, a step not sampled,
            or a sampled copy the GPU had not finished when the step completed).
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
    """Sums over the steps of one pass over a loader (one epoch) on this rank: every step's
    time, data wait and samples; the sampled steps' copy times and data-wait shares."""

    __slots__ = ("epoch", "steps", "samples", "step_s", "wait_s", "h2d_s", "h2d_sq", "h2d_steps",
                 "sampled", "share_sum", "share_sq", "first_wait_s", "mark")
    _FIELDS = ("steps", "samples", "step_s", "wait_s", "h2d_s", "h2d_steps", "first_wait_s",
               "share_sum", "share_sq", "h2d_sq", "sampled")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.steps = self.samples = self.h2d_steps = self.sampled = 0
        self.step_s = self.wait_s = self.h2d_s = self.h2d_sq = self.share_sum = self.share_sq = 0.0
        self.first_wait_s = 0.0
        #: (steps, samples, step s, wait s) when the progress bar's averages last took these in
        self.mark: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)

    def add(self, samples: int, step_s: float, wait_s: float, h2d_s: float | None) -> None:
        """One step, sampled (its copy time and data-wait share kept too)."""
        count_step(self, samples, step_s, wait_s)
        self.add_sample(step_s, wait_s, h2d_s)

    def add_sample(self, step_s: float, wait_s: float, h2d_s: float | None) -> None:
        """The sampled figures of a step already counted."""
        self.sampled += 1
        if h2d_s is not None:
            self.h2d_s += h2d_s
            self.h2d_sq += h2d_s * h2d_s
            self.h2d_steps += 1
        share = wait_s / step_s if step_s > 0 else 0.0
        self.share_sum += share
        self.share_sq += share * share

    def merge(self, other: PassTotals) -> None:
        for name in PassTotals._FIELDS:
            if name != "first_wait_s":
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_list(self) -> list[float]:
        """The figures the end-of-epoch report gathers from every rank."""
        return [float(getattr(self, name)) for name in PassTotals._FIELDS]

    @classmethod
    def from_list(cls, values: list[float], epoch: int) -> PassTotals:
        t = cls(epoch)
        for name, value in zip(PassTotals._FIELDS, values):
            setattr(t, name, int(value) if name in ("steps", "samples", "h2d_steps", "sampled") else value)
        return t

    def summary(self, steady: tuple[int, int, float] | None = None) -> TimingSummary:
        """Totals, rates and shares; ``steady``: (steps, samples, seconds) after warm-up for the rates."""
        n = self.steps
        m = self.sampled
        mean = self.share_sum / m if m else 0.0
        std = math.sqrt(max(0.0, self.share_sq / m - mean * mean)) if m else 0.0
        total = self.step_s
        # the copy: the sampled copies' mean for every step, with the error of that mean
        h2d = h2d_err = None
        k = self.h2d_steps
        if k:
            c_mean = self.h2d_s / k
            h2d = c_mean * n
            if k > 1 and k < n and total > 0:
                c_var = max(0.0, self.h2d_sq / k - c_mean * c_mean) * k / (k - 1)
                h2d_err = _Z95 * math.sqrt(c_var / k) * n / total
            elif k >= n:
                h2d_err = 0.0  # every step was measured
        if steady is not None and steady[0] and steady[2] > 0:
            samples_per_s, steps_per_s = steady[1] / steady[2], steady[0] / steady[2]
        else:
            samples_per_s = self.samples / total if total > 0 else None
            steps_per_s = n / total if total > 0 else None
        return TimingSummary(
            steps=n, samples=self.samples, step_time_s=total, data_wait_s=self.wait_s,
            h2d_s=h2d, compute_s=max(0.0, total - self.wait_s - (h2d or 0.0)),
            samples_per_s=samples_per_s, steps_per_s=steps_per_s,
            data_share=self.wait_s / total if total > 0 else 0.0, data_share_std=std,
            h2d_share=(h2d / total if total > 0 else 0.0) if h2d is not None else None,
            h2d_share_err=h2d_err, h2d_sampled=k,
        )


@dataclass(frozen=True)
class TimingSummary:
    """Steps summed: totals, rates and shares of the step time.

    ``data_share`` is total data wait / total step time (every step measured);
    ``data_share_std`` is the spread of the per-step share over the sampled steps (a loader
    that stalls now and then has a large spread). ``h2d_share`` is estimated from the
    ``h2d_sampled`` steps whose copy was timed; ``h2d_share_err`` is its sampling error (about
    a 95% interval either side; 0 when every step was timed, ``None`` from a single sample).
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
    h2d_share_err: float | None = None
    h2d_sampled: int = 0

    @property
    def compute_share(self) -> float:
        return self.compute_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def copy_text(self) -> str:
        """``copy 12% +-3% (8 of 120 steps timed)``; "" when no copy was measured."""
        if self.h2d_share is None:
            return ""
        if self.h2d_sampled >= self.steps:
            return f"copy {self.h2d_share:.0%}"
        err = "" if self.h2d_share_err is None else f" +-{self.h2d_share_err:.0%}"
        return f"copy {self.h2d_share:.0%}{err} ({self.h2d_sampled} of {self.steps} steps timed)"

    def __str__(self) -> str:
        rate = f"{self.samples_per_s:.1f} samples/s, " if self.samples_per_s else ""
        copy = f", {self.copy_text()}" if self.h2d_share is not None else ""
        ms = 1e3 * self.step_time_s / self.steps if self.steps else 0.0
        return (f"{rate}{ms:.2f} ms/step: data {self.data_share:.0%} "
                f"(+-{self.data_share_std:.0%}){copy}, compute {self.compute_share:.0%}")


def count_step(totals: PassTotals, samples: int, step_s: float, wait_s: float) -> None:
    """Every step's figures (the cheap part of a step's end)."""
    if not totals.steps:
        totals.first_wait_s = wait_s
    totals.steps += 1
    totals.samples += samples
    totals.step_s += step_s
    totals.wait_s += wait_s
