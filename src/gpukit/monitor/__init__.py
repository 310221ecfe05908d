"""Run monitoring: throughput, device utilization sampling and an end-of-run summary."""

from __future__ import annotations

from gpukit.monitor._throughput import Throughput
from gpukit.monitor._utilization import UtilizationSampler, UtilizationSummary

__all__ = ["Throughput", "UtilizationSampler", "UtilizationSummary"]
