"""Data loading: per-process sharding, pinned memory, seeded workers, resumable epochs,
and the step-time breakdown (data wait, host-to-device copy, compute) of every step.

``Session.setup_dataloader`` is the usual entry point; it returns a :class:`DeviceLoader`.
"""

from __future__ import annotations

from gpukit.data._loader import DeviceLoader, build_loader
from gpukit.data._sampler import ResumableBatchSampler
from gpukit.data._timing import StepTiming, StepTimings, TimingSummary
from gpukit.data._workers import auto_num_workers, seed_worker

__all__ = [
    "DeviceLoader",
    "ResumableBatchSampler",
    "StepTiming",
    "StepTimings",
    "TimingSummary",
    "auto_num_workers",
    "build_loader",
    "seed_worker",
]
