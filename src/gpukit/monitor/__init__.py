"""Run monitoring: throughput, FLOPs per step and MFU, utilization sampling, the per-step run record and its events, and
the experiment trackers (CSV, MLflow, Weights & Biases) of ``Session(log_with=...)``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpukit._util.lazy import lazy_exports
from gpukit.monitor._events import EVENT_KINDS, emit
from gpukit.monitor._record import (
    RECORD_FORMAT, RECORD_VERSION, RecordedRank, Recorder, check_scalar, log_event, record_path, start_recorder,
)
from gpukit.monitor._tensorboard import TensorBoardSink, tensorboard_available
from gpukit.monitor._throughput import Throughput
from gpukit.monitor._trackers import CSVTracker, MLflowTracker, Tracker, WandbTracker, make_trackers
from gpukit.monitor._utilization import UtilizationSampler, UtilizationSummary

# resolved on first use: the hub warns through _util.warnings, which imports torch, and the
# doctor loads this package (through worker/) without torch
_LAZY: dict[str, str] = {
    "TrackerHub": "gpukit.monitor._tracking",
    # FLOP counting and MFU (torch only once counting starts)
    "FlopWindow": "gpukit.monitor._flops", "MfuFigures": "gpukit.monitor._flops",
    "PeakChoice": "gpukit.monitor._flops", "check_flops_per_step": "gpukit.monitor._flops",
    "check_peak_tflops": "gpukit.monitor._flops", "format_flops": "gpukit.monitor._flops",
    "matmul_dtype": "gpukit.monitor._flops", "mfu_figures": "gpukit.monitor._flops",
    "resolve_peak": "gpukit.monitor._flops", "tf32_matmuls_on": "gpukit.monitor._flops",
}

__all__ = [
    "CSVTracker", "EVENT_KINDS", "MLflowTracker", "RECORD_FORMAT", "RECORD_VERSION", "RecordedRank", "Recorder",
    "TensorBoardSink", "Throughput", "Tracker", "WandbTracker", "UtilizationSampler", "UtilizationSummary",
    "check_scalar", "emit", "log_event", "make_trackers", "record_path", "start_recorder", "tensorboard_available",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from gpukit.monitor._flops import (
        FlopWindow, MfuFigures, PeakChoice, check_flops_per_step, check_peak_tflops, format_flops, matmul_dtype,
        mfu_figures,
        resolve_peak, tf32_matmuls_on,
    )
    from gpukit.monitor._tracking import TrackerHub
