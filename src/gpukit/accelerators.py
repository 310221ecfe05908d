"""Accelerators: the one place that branches on backend names ("cuda", "mps", "cpu").

Everything else receives an :class:`Accelerator` object and calls its methods. Base methods do
the CPU thing (or nothing), so each backend overrides only what differs.
"""

from __future__ import annotations

import contextlib
import os
import time


from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil
import torch

from gpukit.errors import ConfigurationError

if TYPE_CHECKING:
    from gpukit.devices import GpuSnapshot

__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "FakeCUDAAccelerator",
    "SYNC_COUNTS",
    "SyncCounts",
    "MPSAccelerator",
    "get_accelerator",
    "auto_device_type",
    "DEVICE_TYPES",
    "KernelWindow",
    "SpeedTraits",
]

DEVICE_TYPES = ("cpu", "cuda", "mps")


class SyncCounts:
    """What gpukit's own code asked of a device that the host may wait for: host
    synchronisations (``synchronize``, reading a device value) and device events (creating,
    recording, querying, timing one). One process-wide counter (:data:`SYNC_COUNTS`): the
    rule "no sync and no event in a steady-state step" is checked by reading it around steps.

    Attributes:
        syncs: host synchronisations issued through an :class:`Accelerator`.
        events: device-event operations issued through an :class:`Accelerator`.
    """

    __slots__ = ("syncs", "events")

    def __init__(self) -> None:
        self.syncs = 0
        self.events = 0

    def total(self) -> int:
        """Syncs and events together."""
        return self.syncs + self.events

    def __repr__(self) -> str:
        return f"SyncCounts(syncs={self.syncs}, events={self.events})"


#: the process's count of gpukit's syncs and device events (every accelerator adds to it)
SYNC_COUNTS = SyncCounts()


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


_BY_TYPE: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "mps": MPSAccelerator,
}


def get_accelerator(device: torch.device | str) -> Accelerator:
    """The accelerator for a device or device-type string (``"cuda:1"`` -> CUDA).

    Raises:
        ConfigurationError: for a device type gpukit does not support.
    """
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    cls = _BY_TYPE.get(device_type)
    if cls is None:
        raise ConfigurationError(
            f"Unsupported device type {device_type!r}; gpukit supports {', '.join(DEVICE_TYPES)}."
        )
    return cls()


def auto_device_type() -> str:
    """The best device type this process can use: "cuda", then "mps", then "cpu"."""
    for device_type in ("cuda", "mps"):
        if _BY_TYPE[device_type]().is_available():
            return device_type
    return "cpu"
