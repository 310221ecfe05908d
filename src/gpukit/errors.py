"""gpukit's one error hierarchy.

Every error gpukit raises on purpose is a :class:`GpukitError`. Messages say what was given,
what is allowed, and how to fix it. Subclasses also inherit from the matching built-in
exception where one fits, so ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

__all__ = [
    "GpukitError",
    "ConfigurationError",
    "DeviceError",
    "GpuSelectionError",
    "ClaimTimeoutError",
    "CudaAlreadyInitializedError",
    "FakeSpecError",
    "DistributedError",
    "LaunchError",
    "CheckpointError",
    "UnsafeCheckpointError",
    "StateDictMismatchError",
    "MemoryPlanError",
    "DataStallError",
]


class GpukitError(Exception):
    """Base class of every error gpukit raises on purpose."""


class ConfigurationError(GpukitError, ValueError):
    """A setting, argument or string option that gpukit does not accept."""


class DeviceError(GpukitError, RuntimeError):
    """A device that was asked for is not there or cannot be used."""


class GpuSelectionError(DeviceError):
    """Too few GPUs meet the selection criteria; the message names each GPU and why."""


class ClaimTimeoutError(GpuSelectionError, TimeoutError):
    """Waiting for GPUs to become free ran past its timeout."""


class CudaAlreadyInitializedError(DeviceError):
    """``CUDA_VISIBLE_DEVICES`` would be ignored because CUDA is already initialised here."""


class FakeSpecError(ConfigurationError):
    """A fake-GPU spec (``GPUKIT_FAKE_GPUS``) is malformed."""


class DistributedError(GpukitError, RuntimeError):
    """Process-group set-up or a collective failed, or a launch is missing."""


class LaunchError(GpukitError, RuntimeError):
    """Starting, supervising or stopping worker processes failed."""


class CheckpointError(GpukitError, RuntimeError):
    """A checkpoint could not be written, read or applied."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint needs full unpickling, which can run code; refused unless opted in."""


class StateDictMismatchError(CheckpointError):
    """A state dict does not fit a model: missing, unexpected or shape-mismatched keys."""


class MemoryPlanError(GpukitError, RuntimeError):
    """Memory estimation or batch-size search could not complete."""


class DataStallError(GpukitError, RuntimeError):
    """The data loader stopped producing batches: a worker died, the dataset hung, or the
    shared memory that carries batches from workers ran out; the message names which."""
