"""A CUDA-like accelerator on the CPU, for tests and benchmarks of what gpukit decides on a GPU."""

from __future__ import annotations

import time
from typing import Any

import torch

from gpukit.accelerators._base import CPUAccelerator

__all__ = ["FakeCUDAAccelerator"]


class FakeCUDAAccelerator(CPUAccelerator):
    """A CUDA-like accelerator that runs on the CPU, for tests and benchmarks of what gpukit
    decides on a GPU: it benefits from pinned memory, is not the host (batches are "copied"),
    has timing events that are recorded, queried and timed, and counts every sync and event in
    :data:`SYNC_COUNTS` as CUDA would. Tensors stay on the CPU (``device()`` is the CPU), so a
    whole Session runs with it on a machine without a GPU: ``Session(accelerator=FakeCUDAAccelerator())``.

    Its pinned buffers are ordinary host tensors that it remembers as pinned, so the code that
    reuses them (the loader's pinned pool) runs as on CUDA.
    """

    benefits_from_pinned_memory = True
    is_host = False

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    @property
    def has_timing_events(self) -> bool:
        return True

    def _new_event(self) -> Any | None:
        return _FakeEvent()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype)
        buffer._gpukit_fake_pinned = True  # type: ignore[attr-defined]  # a tensor keeps attributes
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return getattr(tensor, "_gpukit_fake_pinned", False)

    def copy_to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        # a copy to a device is a new tensor: the batch must not share the pooled buffer
        return tensor.clone()

    def read_scalar(self, value: torch.Tensor) -> float:
        self.counts.syncs += 1  # its "device" tensors live on the host: every read counts, as on CUDA
        return float(value)


class _FakeEvent:
    """A CUDA event's interface on the host clock: work on the CPU is done when it returns, so
    an event is passed as soon as it is recorded."""

    __slots__ = ("t_s",)

    def __init__(self) -> None:
        self.t_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t_s = time.perf_counter()

    def query(self) -> bool:
        return self.t_s is not None

    def synchronize(self) -> None:
        """Nothing to wait for: host work is done when it returns."""

    def elapsed_time(self, end: _FakeEvent) -> float:
        if self.t_s is None or end.t_s is None:
            raise RuntimeError("elapsed_time of an event that was not recorded")
        return (end.t_s - self.t_s) * 1e3  # milliseconds, as torch.cuda.Event
