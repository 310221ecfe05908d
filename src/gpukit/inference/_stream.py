"""Offloaded units streamed onto the execution device, ``prefetch`` units ahead of the one computing.

Each offloaded unit's tensors are laid out in one flat byte buffer (views 512-byte aligned, as the
CUDA allocator aligns tensors); there are ``prefetch + 1`` such *slots* on the execution device,
and unit ``j`` of the offloaded order takes a free slot, or one holding a unit outside the window of the one computing and the
``prefetch`` after it. When unit ``j`` starts (a forward pre-hook), it waits for its slot to be
filled, binds its parameters to views of the slot, and asks for the ``prefetch`` units after it
(cyclically: the next forward starts over) -- in steady state into the slot unit ``j - 1`` just
left. When it ends (a forward hook) its parameters go back to the meta placeholders and the slot
is marked free (an event on the compute stream, so a copy into it waits for the compute that
reads it, never the host).

Where the bytes come from:

- CPU RAM (GPU execution): each unit's weights sit in one pinned host buffer, copied on a side stream;
- disk, computed on by the host: the tensors are views of a private memory map of the original
  file (no copy); the background thread touches the next units' pages so the kernel reads them
  while the current one computes, and a unit's pages are dropped from the process when it ends;
- disk, for a GPU: read from the original file (``preadv``) into a pinned staging buffer, then a
  side-stream copy, by one background thread: reads overlap compute.

A unit that runs out of the expected order (a model that skips a layer) is filled when it starts:
correct, only slower. Only ``gpukit.accelerators`` knows which backend does what.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpukit.accelerators import Accelerator

__all__ = ["StreamedTensor", "StreamedUnit", "UnitStreamer"]

_ALIGN = 512  # as CUDA's allocator aligns: kernels see the alignment they would in a resident model


@dataclass
class StreamedTensor:
    """One tensor of an offloaded unit: where it goes in the slot, where its bytes come from, and
    every (module, attribute) that holds it (tied names share one)."""

    key: str  # its name in the checkpoint
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    holders: list[tuple[nn.Module, str, bool]] = field(default_factory=list)  # (module, attr, is parameter)

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass
class StreamedUnit:
    """An offloaded unit: its tensors laid out in a slot, and a host buffer when it lives in CPU RAM."""

    name: str
    module: nn.Module
    tensors: list[StreamedTensor]
    host: torch.Tensor | None = None  # its bytes in (pinned) host memory; None: read from disk
    mapped: dict[str, torch.Tensor] | None = None  # zero-copy views of the file (the host computes on them)

    def layout(self) -> int:
        """Give each tensor its offset; returns the unit's slot bytes."""
        end = 0
        for t in self.tensors:
            t.offset = -(-end // _ALIGN) * _ALIGN
            end = t.offset + t.nbytes
        return end


@dataclass
class _Slot:
    device: torch.Tensor  # uint8, on the execution device
    staging: torch.Tensor | None  # pinned uint8 host buffer (disk reads for a GPU)
    unit: int | None = None
    ready: Future[Any] | None = None
    freed: Any | None = None  # compute event after its last reader
    staged_copy: Any | None = None  # the copy out of ``staging`` still in flight


def _view(buffer: torch.Tensor, t: StreamedTensor) -> torch.Tensor:
    return buffer[t.offset:t.offset + t.nbytes].view(t.dtype).view(t.shape)


class UnitStreamer:
    """Streams ``units`` (in forward order) onto ``device`` (see the module docstring)."""

    def __init__(self, units: list[StreamedUnit], device: torch.device, accelerator: Accelerator,
                 read: Callable[[str, torch.Tensor], None], prefetch: int = 1,
                 release: Callable[[str], None] | None = None) -> None:
        self.units = units
        self.device = device
        self.accelerator = accelerator
        self._read = read  # (checkpoint key, CPU uint8/dtype view) -> fills it from the file
        self._release = release  # (checkpoint key) -> a mapped tensor's pages leave this process
        self.slot_bytes = max((u.layout() for u in units if u.mapped is None), default=0)
        count = min(prefetch + 1, len(units))
        gpu_side = not accelerator.is_host
        on_disk = any(u.host is None for u in units)
        # disk reads for a GPU land here: the largest disk unit's bytes (the plan counts those), not the
        # largest unit's -- a bigger unit in pinned CPU RAM never passes through the staging buffer
        staging_bytes = max((u.layout() for u in units if u.host is None and u.mapped is None), default=0)
        self.slots = [_Slot(torch.empty(self.slot_bytes, dtype=torch.uint8, device=device),
                            accelerator.pinned_empty((staging_bytes,), torch.uint8) if gpu_side and on_disk else None)
                      for _ in range(count)]
        # the slots' blocks come from the compute stream's cache, perhaps freed by work still queued on it
        # (a quantised weight's transient float copy): the side stream's first copy into them waits for it
        made = accelerator.compute_event(device)
        for slot in self.slots:
            slot.freed = made
        self.prefetch = prefetch
        self._stream = accelerator.side_stream(device)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpukit-offload") if on_disk else None
        self._placeholders: dict[int, dict[tuple[int, str], Any]] = {}
        self._bound: dict[int, _Slot] = {}  # unit -> the slot its parameters view while it computes
        self._current = 0
        self._lock = threading.Lock()
        self.bytes_streamed = 0
        self.wait_s = 0.0  # compute time spent waiting for a slot to fill
        self._handles = []
        for index, unit in enumerate(units):
            self._handles.append(unit.module.register_forward_pre_hook(self._enter(index)))
            self._handles.append(unit.module.register_forward_hook(self._leave(index)))

    def close(self) -> None:
        """Remove the hooks and stop the reader thread."""
        for handle in self._handles:
            handle.remove()
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    # -- filling slots --------------------------------------------------------------------------
    def _fill(self, index: int, slot: _Slot) -> Any | None:
        """Put unit ``index``'s bytes into ``slot`` (background thread for disk); returns the event
        the compute stream waits on."""
        unit = self.units[index]
        with self._lock:
            self.bytes_streamed += sum(t.nbytes for t in unit.tensors)
        if unit.mapped is not None:  # the host computes on the file's pages: fault them in ahead
            for view in unit.mapped.values():
                flat = view.reshape(-1).view(torch.uint8)
                if flat.numel():
                    flat[::4096].sum()  # one byte per page: the kernel reads the page (torch lets go of the GIL)
            return None
        if unit.host is not None:
            return self.accelerator.copy_on_stream(slot.device[:unit.host.numel()], unit.host, self._stream, slot.freed)
        target = slot.staging if slot.staging is not None else slot.device
        if slot.staging is not None and slot.staged_copy is not None:
            self.accelerator.wait_event(slot.staged_copy)  # this thread waits, not the GPU
        for t in unit.tensors:
            self._read(t.key, _view(target, t))
        if slot.staging is None:
            return None
        size = max(t.offset + t.nbytes for t in unit.tensors)
        slot.staged_copy = self.accelerator.copy_on_stream(slot.device[:size], slot.staging[:size], self._stream,
                                                           slot.freed)
        return slot.staged_copy

    def _window(self) -> set[int]:
        """The unit computing and the ``prefetch`` after it (cyclically: the next forward starts over)."""
        return {(self._current + ahead) % len(self.units) for ahead in range(self.prefetch + 1)}

    def _request(self, index: int) -> _Slot:
        for slot in self.slots:
            if slot.unit == index:
                return slot
        keep = self._window()
        slot = next((s for s in self.slots if s.unit is None), None) or next(
            (s for s in self.slots if s.unit not in keep), None) or next(
            s for s in self.slots if s.unit != self._current)
        if slot.ready is not None:
            slot.ready.result()  # a fill still running into this slot: let it finish first
        slot.unit = index
        if self.units[index].host is not None or self._reader is None:
            done: Future[Any] = Future()
            done.set_result(self._fill(index, slot))
            slot.ready = done
        else:
            slot.ready = self._reader.submit(self._fill, index, slot)
        return slot

    # -- hooks ----------------------------------------------------------------------------------
    def _enter(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._current = index
            slot = self._request(index)
            start = time.perf_counter()
            event = slot.ready.result() if slot.ready is not None else None
            self.wait_s += time.perf_counter() - start
            self.accelerator.wait_on_compute(event, self.device)
            self._bind(index, slot)
            for ahead in range(1, self.prefetch + 1):
                following = (index + ahead) % len(self.units)
                if following != index:
                    self._request(following)
        return hook

    def _leave(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._unbind(index)
            if self.units[index].mapped is not None and self._release is not None:
                for key in self.units[index].mapped:
                    self._release(key)
            slot = self._bound.pop(index, None)  # the slot it read: units do not sit in slot (index % slots)
            if slot is not None:
                slot.freed = self.accelerator.compute_event(self.device)
        return hook

    def _bind(self, index: int, slot: _Slot) -> None:
        saved: dict[tuple[int, str], Any] = {}
        mapped = self.units[index].mapped
        for t in self.units[index].tensors:
            view = mapped[t.key] if mapped is not None else _view(slot.device, t)
            value: Any = nn.Parameter(view, requires_grad=False)
            for module, attr, is_param in t.holders:
                table = module._parameters if is_param else module._buffers
                saved[(id(module), attr)] = (table, table[attr])
                table[attr] = value if is_param else view
        self._placeholders[index] = saved
        self._bound[index] = slot

    def _unbind(self, index: int) -> None:
        for (_, attr), (table, placeholder) in self._placeholders.pop(index, {}).items():
            table[attr] = placeholder
