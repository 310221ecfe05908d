"""The GPU backends: CUDA (NCCL, pinned copies, streams, NVML snapshots, a kernel timeline from the
profiler) and Apple's MPS; each overrides only what differs from the CPU's :class:`Accelerator`."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch

from gpukit.accelerators._base import Accelerator, KernelWindow, SpeedTraits

if TYPE_CHECKING:
    from gpukit.devices import GpuSnapshot

__all__ = ["CUDAAccelerator", "MPSAccelerator"]


class _CudaKernelWindow(KernelWindow):
    """Kernel busy time from torch's profiler (CUPTI): the union of the kernels' intervals."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profiler: Any = None
        self._start_s = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(self.device)  # the window holds only its own steps' kernels
        try:
            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.__enter__()
        except Exception:  # noqa: BLE001 - no CUPTI, or a profiler already running: the decision says "not measured"
            self._profiler = None
        self._start_s = time.perf_counter()

    def stop(self) -> tuple[float, float] | None:
        from torch.autograd import DeviceType

        torch.cuda.synchronize(self.device)  # the caller's wall clock then covers the GPU's work too
        wall_s = time.perf_counter() - self._start_s
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        try:
            profiler.__exit__(None, None, None)
            spans = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                           if e.device_type == DeviceType.CUDA)
        except Exception:  # noqa: BLE001 - a profiler that failed to collect: "not measured", training goes on
            return None
        busy_us, end = 0.0, float("-inf")
        for lo, hi in spans:  # kernels on several streams overlap: count the union once
            if hi > end:
                busy_us += hi - max(lo, end)
                end = hi
        return wall_s, busy_us / 1e6


class CUDAAccelerator(Accelerator):
    type = "cuda"
    distributed_backend = "nccl"
    benefits_from_pinned_memory = True
    is_host = False

    def auto_precision(self, device: torch.device | None = None) -> str:
        # Tensor cores: bf16 where native (Ampere+), else fp16 with a GradScaler.
        return "bf16-mixed" if self.supports_bf16(device) else "16-mixed"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def device_scope(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def _synchronize(self, device: torch.device | None) -> None:
        torch.cuda.synchronize(device)

    @property
    def has_timing_events(self) -> bool:
        return True

    def _new_event(self) -> Any | None:
        return torch.cuda.Event(enable_timing=True)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_host_async(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any | None]:
        # The copy runs on the current stream of the tensor's device, and the event (recorded on the
        # current stream of the *current* device) must follow it there: a value on cuda:1 while cuda:0
        # is current (a loss on the last stage of a model split over GPUs) would otherwise be "done"
        # before its copy ran, and read as whatever the pinned buffer held.
        if tensor.device.type != "cuda":
            return super().to_host_async(tensor)
        with torch.cuda.device(tensor.device):
            return super().to_host_async(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def empty_cache(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def supports_bf16(self, device: torch.device | None = None) -> bool:
        # Native bf16 needs compute capability 8.0 (Ampere); older GPUs emulate it slowly.
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        return major >= 8

    def is_initialized(self) -> bool:
        return torch.cuda.is_initialized()

    def speed_traits(self, device: torch.device) -> SpeedTraits:
        major, minor = torch.cuda.get_device_capability(device)
        return SpeedTraits(name=torch.cuda.get_device_name(device), capability=(major, minor), tf32=major >= 8,
                           tensor_cores=major >= 7, cuda_graphs=True, flash_attention=major >= 8)

    def enable_tf32(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = True  # off by default since torch 1.12
        torch.backends.cudnn.allow_tf32 = True  # on by default; a script may have turned it off

    def enable_attention_kernels(self) -> None:
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(True)

    def kernel_window(self, device: torch.device) -> KernelWindow:
        return _CudaKernelWindow(device)

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        return (torch.cuda.OutOfMemoryError,)

    def side_stream(self, device: torch.device) -> Any | None:
        return torch.cuda.Stream(device=device)

    def copy_on_stream(self, dest: torch.Tensor, source: torch.Tensor, stream: Any | None,
                       after: Any | None = None) -> Any | None:
        if stream is None:
            return super().copy_on_stream(dest, source, stream, after)
        with torch.no_grad(), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dest.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.counts.events += 2 if after is not None else 1
        return done

    def compute_event(self, device: torch.device) -> Any | None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.counts.events += 1
        return event

    def wait_on_compute(self, event: Any | None, device: torch.device) -> None:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
            self.counts.events += 1

    def memory_stats(self, device: torch.device | None = None) -> dict[str, Any]:
        stats = super().memory_stats(device)
        if not torch.cuda.is_initialized():
            return stats
        raw = torch.cuda.memory_stats(device)
        stats.update(
            allocated_bytes=raw.get("allocated_bytes.all.current", 0),
            reserved_bytes=raw.get("reserved_bytes.all.current", 0),
            peak_allocated_bytes=raw.get("allocated_bytes.all.peak", 0),
            peak_reserved_bytes=raw.get("reserved_bytes.all.peak", 0),
            alloc_retries=raw.get("num_alloc_retries", 0),
            num_ooms=raw.get("num_ooms", 0),
        )
        return stats

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(device)

    def free_memory_bytes(self, device: torch.device) -> int | None:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)

    def gpu_snapshot(self, device: torch.device) -> GpuSnapshot | None:
        try:
            from gpukit.devices import logical_to_physical

            return dict(logical_to_physical()).get(device.index or 0)
        except Exception:  # noqa: BLE001 - display only: no driver or a fake-spec error means no NVML figures
            return None

    def with_index(self, device: torch.device) -> torch.device:
        return device if device.index is not None else torch.device(self.type, 0)

    def record_memory_history(self, enabled: bool, max_entries: int) -> bool:
        if not self.is_available():
            return False
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)
        return enabled

    def allocator_snapshot(self) -> dict[str, Any] | None:
        return torch.cuda.memory._snapshot() if self.is_initialized() else None

    def manual_seed_all(self, seed: int) -> None:
        # Lazy in torch: seeds each GPU when CUDA initialises, so this never initialises CUDA.
        torch.cuda.manual_seed_all(seed)


class MPSAccelerator(Accelerator):
    type = "mps"
    distributed_backend = "gloo"
    is_host = False

    def is_available(self) -> bool:
        return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("mps")

    def _synchronize(self, device: torch.device | None) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def supports_bf16(self, device: torch.device | None = None) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)
