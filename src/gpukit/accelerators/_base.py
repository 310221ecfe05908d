"""The Accelerator interface, whose methods do the CPU thing (or nothing), and the CPU's accelerator;
what a device rewards (:class:`SpeedTraits`) and how a window of its kernels is timed (:class:`KernelWindow`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch

from gpukit.accelerators._counts import SYNC_COUNTS, SyncCounts

if TYPE_CHECKING:
    from gpukit.devices import GpuSnapshot

__all__ = ["Accelerator", "CPUAccelerator", "KernelWindow", "SpeedTraits"]


@dataclass(frozen=True)
class SpeedTraits:
    """What a device rewards, for the automatic settings (``gpukit.session._auto_decide``).

    Attributes:
        name: the device's name ("NVIDIA H100 80GB HBM3", "cpu").
        capability: CUDA compute capability, ``None`` elsewhere.
        tf32: TF32 tensor cores (Ampere+).
        tensor_cores: fp16/bf16 tensor cores (Volta+).
        cuda_graphs: can capture CUDA graphs.
        flash_attention: runs the flash attention kernel (Ampere+).
    """

    name: str
    capability: tuple[int, int] | None = None
    tf32: bool = False
    tensor_cores: bool = False
    cuda_graphs: bool = False
    flash_attention: bool = False


class KernelWindow:
    """Measures, over a window of steps, the wall time and the time the device ran kernels.

    ``start()`` before the first step of the window, ``stop()`` after its last: returns
    ``(wall_s, busy_s)``, or ``None`` where the device has no kernel timeline (the CPU). One
    synchronisation at each end: a one-off measurement, not a per-step cost.
    """

    def start(self) -> None:
        """Begin the window."""

    def stop(self) -> tuple[float, float] | None:
        """End the window: ``(wall_s, busy_s)``, or ``None`` when not measurable here."""
        return None


class Accelerator:
    """A device type and what gpukit needs to know about it. The base class is the CPU."""

    type: str = "cpu"
    #: backend of ``torch.distributed`` for this device type
    distributed_backend: str = "gloo"
    #: whether pinned host memory speeds up copies to this device
    benefits_from_pinned_memory: bool = False
    #: the host CPU: "N devices" means N processes, not N chips
    is_host: bool = True

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.type) if index is None else torch.device(self.type, index)

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process (no-op off CUDA)."""

    def current_device(self) -> torch.device:
        """This process's current device of this type (the one ``set_device`` chose)."""
        return self.device()

    def device_scope(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``device`` is current (new tensors and kernels go there)."""
        return contextlib.nullcontext()

    #: the process-wide count of the syncs and events issued through any accelerator
    counts: SyncCounts = SYNC_COUNTS

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for queued work on ``device`` (no-op on the CPU; counted elsewhere)."""
        if not self.is_host:
            self.counts.syncs += 1
        self._synchronize(device)

    def _synchronize(self, device: torch.device | None) -> None:
        """The backend's wait (what :meth:`synchronize` does after counting)."""

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver (no-op on the CPU)."""

    @property
    def has_timing_events(self) -> bool:
        """Whether :meth:`timing_event` gives events (device work can be timed without a sync)."""
        return False

    def timing_event(self) -> Any | None:
        """A new event that times device work without a sync, recorded now on the current
        stream (``None``: the backend has none). Counted as one event."""
        event = self._new_event()
        if event is not None:
            self.counts.events += 1
            event.record()
        return event

    def _new_event(self) -> Any | None:
        return None

    def event_done(self, event: Any) -> bool:
        """Whether the device has passed ``event`` (a query: no wait). Counted as one event."""
        self.counts.events += 1
        return bool(event.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two events the device has passed (see :meth:`event_done`)."""
        return float(start.elapsed_time(end)) / 1e3

    def read_scalar(self, value: torch.Tensor) -> float:
        """``float(value)``: on a device that is a host synchronisation, counted as one."""
        if not self.is_host and value.device.type != "cpu":
            self.counts.syncs += 1
        return float(value)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer the device copies from without staging (page-locked where the backend
        has such memory; plain host memory elsewhere)."""
        return torch.empty(shape, dtype=dtype)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory the device copies from asynchronously."""
        return False

    def copy_to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``; asynchronous from a pinned buffer (the host must not write
        the buffer again before the device has passed an event recorded after this copy)."""
        return tensor.to(device, non_blocking=self.is_pinned(tensor))

    def to_host_async(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any | None]:
        """Start copying ``tensor`` into host memory without waiting: ``(host, event)``, where
        ``host`` holds the values once the device has passed ``event`` (:meth:`event_done`);
        ``event`` is ``None`` when the values are there already. One event, counted."""
        if not self.has_timing_events:
            if tensor.device.type != "cpu" and not self.is_host:
                self.counts.syncs += 1  # no events to wait on: a plain (blocking) read
            return tensor.to("cpu"), None
        host = self.pinned_empty(tuple(tensor.shape), tensor.dtype)
        host.copy_(tensor, non_blocking=True)
        return host, self.timing_event()

    def wait_event(self, event: Any) -> None:
        """Block until the device has passed ``event`` (a host synchronisation, counted)."""
        self.counts.syncs += 1
        event.synchronize()

    # -- weights streamed onto the device while it computes (gpukit.inference) -----------------
    def side_stream(self, device: torch.device) -> Any | None:
        """A stream for copies that overlap the compute stream; ``None`` where work is not queued
        (the host computes as it is told: a copy is done when it returns)."""
        return None

    def copy_on_stream(self, dest: torch.Tensor, source: torch.Tensor, stream: Any | None,
                       after: Any | None = None) -> Any | None:
        """Copy ``source`` into ``dest`` on ``stream``, once the compute stream has passed ``after``
        (an event from :meth:`compute_event`: ``dest`` is free again); returns the event the compute
        stream must wait on before reading ``dest`` (``None``: the copy is done)."""
        with torch.no_grad():
            dest.copy_(source)
        return None

    def compute_event(self, device: torch.device) -> Any | None:
        """An event recorded on ``device``'s compute stream now (``None`` on the host: done already)."""
        return None

    def wait_on_compute(self, event: Any | None, device: torch.device) -> None:
        """Make the compute stream wait for ``event`` without the host waiting (no-op for ``None``)."""

    def supports_bf16(self, device: torch.device | None = None) -> bool:
        return True

    def supports_fp16_autocast(self) -> bool:
        # CPU autocast accepts float16 from torch 2.4 on, but it is slow and rarely useful.
        return True

    def auto_precision(self, device: torch.device | None = None) -> str:
        """The precision ``"auto"`` means here; mixed precision rarely pays off on the CPU."""
        return "32-true"

    def is_initialized(self) -> bool:
        """Whether this backend's runtime was already initialised in this process."""
        return False

    def oom_error_types(self) -> tuple[type[BaseException], ...]:
        """Exception types that mean "out of memory" on this device."""
        return (torch.OutOfMemoryError,)

    def memory_stats(self, device: torch.device | None = None) -> dict[str, Any]:
        """Memory counters of this process on ``device``; ``None`` where not available.

        Keys: ``allocated_bytes``, ``reserved_bytes``, ``peak_allocated_bytes``,
        ``peak_reserved_bytes``, ``alloc_retries``, ``num_ooms``, ``process_rss_bytes``.
        """
        return {
            "allocated_bytes": None,
            "reserved_bytes": None,
            "peak_allocated_bytes": None,
            "peak_reserved_bytes": None,
            "alloc_retries": None,
            "num_ooms": None,
            "process_rss_bytes": psutil.Process(os.getpid()).memory_info().rss,
        }

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        """Start a new peak-memory window (no-op on the CPU)."""

    def free_memory_bytes(self, device: torch.device) -> int | None:
        """The device's free memory now, for any process (the driver's figure); ``None``: not reported."""
        return None

    def gpu_snapshot(self, device: torch.device) -> GpuSnapshot | None:
        """What NVML reports of ``device`` now (name, physical index, memory, utilization); ``None``
        where NVML does not describe this backend, or there is no driver."""
        return None

    def with_index(self, device: torch.device) -> torch.device:
        """``device`` with the index a bare type means here (``cuda`` -> ``cuda:0``)."""
        return device

    def record_memory_history(self, enabled: bool, max_entries: int) -> bool:
        """Start (or stop) recording allocation stacks; whether recording is now on (``False``:
        this backend's allocator keeps no history)."""
        return False

    def allocator_snapshot(self) -> dict[str, Any] | None:
        """The caching allocator's snapshot (segments, blocks, their stacks); ``None`` where there is
        none, or the runtime has not started in this process."""
        return None

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device of this type (the CPU generator is seeded by torch.manual_seed)."""

    # -- what the automatic settings ask of a device (session/_auto.py) ---------------------
    def speed_traits(self, device: torch.device) -> SpeedTraits:
        """What ``device`` rewards: none of the GPU settings here."""
        return SpeedTraits(name=self.type)

    def enable_tf32(self) -> None:
        """Let fp32 matmuls and convolutions use TF32 tensor cores (no-op without them)."""

    def enable_attention_kernels(self) -> None:
        """Make sure the flash and memory-efficient attention kernels may run (no-op here)."""

    def kernel_window(self, device: torch.device) -> KernelWindow:
        """A :class:`KernelWindow` for ``device`` (here one that measures nothing)."""
        return KernelWindow()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CPUAccelerator(Accelerator):
    pass

