"""Run monitoring: throughput, utilization sampling, the per-step run record and its events, and
the experiment trackers (CSV, MLflow, Weights & Biases) of ``Session(log_with=...)``."""

from __future__ import annotations

from gpukit.monitor._events import EVENT_KINDS, emit
from gpukit.monitor._record import RECORD_FORMAT, RECORD_VERSION, Recorder, log_event, record_path, start_recorder
from gpukit.monitor._tensorboard import TensorBoardSink, tensorboard_available
from gpukit.monitor._throughput import Throughput
from gpukit.monitor._trackers import CSVTracker, MLflowTracker, Tracker, WandbTracker
from gpukit.monitor._utilization import UtilizationSampler, UtilizationSummary

__all__ = [
    "CSVTracker", "EVENT_KINDS", "MLflowTracker", "RECORD_FORMAT", "RECORD_VERSION", "Recorder", "TensorBoardSink",
    "Throughput", "Tracker", "WandbTracker", "UtilizationSampler", "UtilizationSummary", "emit", "log_event",
    "record_path", "start_recorder", "tensorboard_available",
]
