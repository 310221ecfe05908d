"""Data loading: per-process sharding, pinned memory, seeded workers, resumable epochs,
the step-time breakdown (data wait, host-to-device copy, compute) of every step with an
end-of-epoch diagnosis, loader tuning (``tune_loader``) and stalled-loader errors.

``Session.setup_dataloader`` is the usual entry point; it returns a :class:`DeviceLoader`.
"""

from __future__ import annotations

from gpukit.data._advice import EpochReport
from gpukit.data._build import LoaderRequest, build_loader
from gpukit.data._loader import DeviceLoader, LoaderListener, LoaderPlace
from gpukit.data._loader_settings import LoaderSettings
from gpukit.data._sampler import ResumableBatchSampler
from gpukit.data._stall import DEFAULT_DATA_TIMEOUT_S, SharedMemoryWarning
from gpukit.data._timing import StepTiming, StepTimings, TimingSummary, timed_progress
from gpukit.data._tune import tune_loader
from gpukit.data._tune_result import Trial, TuneResult
from gpukit.data._workers import auto_num_workers, seed_worker

__all__ = [
    "DEFAULT_DATA_TIMEOUT_S",
    "DeviceLoader",
    "EpochReport",
    "LoaderListener",
    "LoaderPlace",
    "LoaderRequest",
    "LoaderSettings",
    "ResumableBatchSampler",
    "SharedMemoryWarning",
    "StepTiming",
    "StepTimings",
    "TimingSummary",
    "Trial",
    "TuneResult",
    "auto_num_workers",
    "build_loader",
    "seed_worker",
    "timed_progress",
    "tune_loader",
]
