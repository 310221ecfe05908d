"""FLOPs per step, achieved TFLOP/s and MFU (model FLOPs utilisation), counted once and shown right.

MFU = the FLOP/s a training step achieves / the device's DENSE peak in the dtype the maths runs in.
Three things make it wrong in the wild, and each has one owner here:

* the FLOPs: counted by torch's own :class:`torch.utils.flop_counter.FlopCounterMode` over one
  real training step (forward, loss and backward: what the device really did, attention and
  recomputed activations included) -- or given by the user when they know better
  (``Session(flops_per_step=...)``). Counted once, on the second step (the first compiles), never again: the counter slows
  that one step (every op goes through a Python dispatch mode), never another.
* the peak: the data sheet's dense figure for this device and dtype (:func:`gpukit.devices.dense_peak`,
  never the 2:4-sparsity figure), or ``Session(peak_tflops=...)`` for a device the table lacks
  (CPUs included); ``None`` -- "MFU not known" -- otherwise, while achieved TFLOP/s is still shown.
* the dtype: the precision that runs (:func:`matmul_dtype`): bf16-mixed -> bf16; 32-true -> tf32
  when TF32 matmuls are on, else fp32.

torch is imported where it is used: ``gpukit report`` reads the formatting without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gpukit.errors import ConfigurationError

__all__ = ["FlopWindow", "MfuFigures", "PeakChoice", "check_flops_per_step", "check_peak_tflops", "format_flops",
           "matmul_dtype", "mfu_figures", "resolve_peak", "tf32_matmuls_on"]

#: no device in sight does more than this many dense TFLOP/s: a larger figure is a unit mistake
_MAX_PEAK_TFLOPS = 100_000.0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_peak_tflops(value: Any) -> float | None:
    """``Session(peak_tflops=...)`` checked: ``None``, or a finite positive number of TFLOP/s per device.

    Raises:
        ConfigurationError: not a number, not finite, not positive, or so large it must be FLOP/s.
    """
    if value is None:
        return None
    if not _number(value) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(
            f"Session(peak_tflops={value!r}): give the device's dense peak in TFLOP/s (10^12 operations per "
            "second) as a positive number, e.g. peak_tflops=989.4 for an H100 SXM in bf16, or leave it out to "
            "use gpukit's table (gpukit.devices.dense_peak).")
    if value > _MAX_PEAK_TFLOPS:
        raise ConfigurationError(
            f"Session(peak_tflops={value!r}): that is more than {_MAX_PEAK_TFLOPS:,.0f} TFLOP/s per device; "
            f"the unit is TFLOP/s, not FLOP/s (did you mean peak_tflops={value / 1e12:g}?).")
    return float(value)


def check_flops_per_step(value: Any) -> int | None:
    """``Session(flops_per_step=...)`` checked: ``None`` (count them) or a positive whole number.

    Raises:
        ConfigurationError: not a positive number of floating-point operations.
    """
    if value is None:
        return None
    if not _number(value) or not math.isfinite(value) or value < 1 or value != int(value):
        raise ConfigurationError(
            f"Session(flops_per_step={value!r}): give the floating-point operations of one training step "
            "(forward and backward of one micro-batch on one process) as a positive whole number, e.g. "
            "flops_per_step=6 * n_params * tokens_per_step, or leave it out to count them on the second step.")
    return int(value)


def tf32_matmuls_on() -> bool:
    """Whether fp32 matrix products run on TF32 tensor cores (``torch.set_float32_matmul_precision``)."""
    import torch

    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def matmul_dtype(precision_name: str, tf32: bool) -> str:
    """The dtype a precision's matrix products run in, as the peak table names it.

    Args:
        precision_name: a gpukit precision name (``"bf16-mixed"``, ``"16-true"``, ``"32-true"``...).
        tf32: whether fp32 matmuls use TF32 (:func:`tf32_matmuls_on`).
    """
    if precision_name.startswith("bf16"):
        return "bf16"
    if precision_name.startswith("16"):
        return "fp16"
    return "tf32" if tf32 else "fp32"


@dataclass(frozen=True)
class PeakChoice:
    """The peak MFU divides by: ``tflops`` (``None``: not known) and where it came from, in words."""

    tflops: float | None
    dtype: str
    source: str


def resolve_peak(given_tflops: float | None, device_name: str | None, dtype: str) -> PeakChoice:
    """The peak for MFU: the one given, else the table's dense figure for ``device_name`` in ``dtype``."""
    if given_tflops is not None:
        return PeakChoice(given_tflops, dtype, "given: Session(peak_tflops=...)")
    from gpukit.devices import dense_peak

    found = dense_peak(device_name, dtype)
    if found is not None:
        return PeakChoice(found.tflops, dtype, found.source)
    what = f"{device_name!r}" if device_name else "this device"
    return PeakChoice(None, dtype, f"no {dtype} peak known for {what}: give Session(peak_tflops=...)")


def format_flops(tflops: float) -> str:
    """A rate in TFLOP/s as people read it: ``"412 TFLOP/s"``, ``"3.1 GFLOP/s"`` (a CPU)."""
    if tflops >= 1.0:
        return f"{tflops:.4g} TFLOP/s"
    return f"{tflops * 1e3:.3g} GFLOP/s" if tflops >= 1e-3 else f"{tflops * 1e6:.3g} MFLOP/s"


@dataclass(frozen=True)
class MfuFigures:
    """Achieved TFLOP/s of some steps, and MFU against a peak (``None``: not known)."""

    achieved_tflops: float
    mfu: float | None
    peak: PeakChoice

    def text(self) -> str:
        """``"412 TFLOP/s, MFU 41.6% of 989.4 (bf16, data sheet: H100 SXM bf16 dense)"``, for the epoch line."""
        achieved = format_flops(self.achieved_tflops)
        if self.mfu is None:
            return f"{achieved} achieved (MFU not known: {self.peak.source})"
        return f"{achieved}, MFU {100 * self.mfu:.3g}% of {format_flops(self.peak.tflops or 0.0)} ({self.peak.source})"


def mfu_figures(flops_per_step: int, steps: int, seconds: float, peak: PeakChoice) -> MfuFigures | None:
    """MFU of ``steps`` steps of ``flops_per_step`` that took ``seconds`` of wall time; ``None`` without time."""
    if steps <= 0 or seconds <= 0:
        return None
    achieved = flops_per_step * steps / seconds / 1e12
    return MfuFigures(achieved, None if peak.tflops is None else achieved / peak.tflops, peak)


class FlopWindow:
    """Counts the FLOPs torch runs between :meth:`open` and :meth:`close` (one training step).

    A thin owner of :class:`~torch.utils.flop_counter.FlopCounterMode`, opened and closed from
    hooks (a model's first forward, the first ``session.step``) rather than a ``with`` block.
    """

    def __init__(self) -> None:
        self._mode: Any = None

    @property
    def is_open(self) -> bool:
        return self._mode is not None

    def open(self) -> None:
        """Start counting (a no-op when already counting)."""
        if self._mode is None:
            from torch.utils.flop_counter import FlopCounterMode

            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()

    def close(self) -> int:
        """Stop counting; the FLOPs counted since :meth:`open` (0 when it was not open)."""
        mode, self._mode = self._mode, None
        if mode is None:
            return 0
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops())
