"""Pinned host buffers from a reused pool: a pinned batch without a pinned allocation per batch.

A copy to a GPU runs asynchronously only from page-locked ("pinned") host memory. torch's
DataLoader pins each batch anew (``pin_memory=True``: a pinned allocation from torch's caching
host allocator, then a copy into it). Without loader workers that happens in the training
thread, on every step; :class:`PinnedMover` instead copies each batch tensor into a pinned
buffer of the same shape and dtype kept from earlier batches, then starts the copy to the device.

**Reuse without a sync.** The device may still be reading a buffer when the host wants it
again. A buffer handed out goes back to the free list only once a device event recorded after
its copy has been passed, and that is asked without waiting (``event.query()``). The events are
the step timing's own: the end event of each *sampled* copy (:mod:`gpukit.data._timing`)
fences every buffer handed out so far, so the pool records no event of its own and queries only
on sampled steps. Between fences the pool grows to the batches in flight (about
``2 x SAMPLE_EVERY`` batches), up to ``max_bytes``; past that, a batch gets a fresh pinned
buffer outside the pool (what torch's pinning does for every batch) until a fence frees some.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from gpukit.accelerators import Accelerator

__all__ = ["DEFAULT_POOL_BYTES", "PinnedMover", "PinnedPool"]

#: pinned host memory a pool keeps at most (batches past it are pinned afresh, as torch does)
DEFAULT_POOL_BYTES = 512 * 2**20

_Key = tuple[torch.Size, torch.dtype]


class PinnedPool:
    """Pinned host buffers, reused once the device has finished copying from them.

    Args:
        accelerator: allocates the buffers (page-locked on CUDA) and answers event queries.
        max_bytes: the most pinned memory the pool keeps.

    Attributes:
        allocated, reused, outside: buffers allocated for the pool, handed out again, and
            allocated outside it because it was full (counts, for tests and benchmarks).
    """

    def __init__(self, accelerator: Accelerator, max_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self._accelerator = accelerator
        self.max_bytes = int(max_bytes)
        self.held_bytes = 0
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._unfenced: list[torch.Tensor] = []  # handed out since the last fence
        self._fenced: collections.deque[tuple[Any, list[torch.Tensor]]] = collections.deque()
        self.allocated = self.reused = self.outside = 0

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned copy of the host tensor ``tensor`` (contiguous, same shape and dtype)."""
        key = (tensor.shape, tensor.dtype)
        free = self._free.get(key)
        if free:
            buffer = free.pop()
            self.reused += 1
        else:
            nbytes = tensor.numel() * tensor.element_size()
            buffer = self._accelerator.pinned_empty(tuple(tensor.shape), tensor.dtype)
            if self.held_bytes + nbytes > self.max_bytes:
                self.outside += 1  # not kept: freed (to torch's own cache) once the batch is gone
                return buffer.copy_(tensor)
            self.held_bytes += nbytes
            self.allocated += 1
        buffer.copy_(tensor)
        self._unfenced.append(buffer)
        return buffer

    def fence(self, event: Any) -> None:
        """``event`` was recorded on the device after the copies of every buffer handed out so far:
        they are free once it is passed. Frees what earlier fences already allow (queries, no wait)."""
        if self._unfenced:
            self._fenced.append((event, self._unfenced))
            self._unfenced = []
        self.reclaim()

    def reclaim(self) -> int:
        """Put back the buffers of fences the device has passed, oldest first; how many."""
        freed = 0
        done = self._accelerator.event_done
        while self._fenced and done(self._fenced[0][0]):
            _, buffers = self._fenced.popleft()
            for buffer in buffers:
                self._free.setdefault((buffer.shape, buffer.dtype), []).append(buffer)
            freed += len(buffers)
        return freed

    @property
    def in_flight(self) -> int:
        """Buffers handed out and not known to be free yet."""
        return len(self._unfenced) + sum(len(b) for _, b in self._fenced)

    def __repr__(self) -> str:
        return (f"PinnedPool(held={self.held_bytes} bytes, in_flight={self.in_flight}, allocated={self.allocated}, "
                f"reused={self.reused}, outside={self.outside})")


class PinnedMover:
    """Move a batch to ``device`` through pooled pinned buffers: tensors, and tuples, lists and
    dicts of them, the way a DataLoader's batches come; anything else goes by ``fallback``.

    Args:
        device: where batches go.
        accelerator: its backend (the pool's buffers, the copy).
        fallback: the mover for batches of other shapes (``gpukit.placement.device_mover``).
        pool: the pool (a new one by default).
    """

    def __init__(self, device: torch.device, accelerator: Accelerator, fallback: Callable[[Any], Any],
                 pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = pool if pool is not None else PinnedPool(accelerator)
        self._accelerator = accelerator
        self._fallback = fallback
        #: handed the step timing's sampled copy-end events (see the module docstring)
        self.fence = self.pool.fence

    def __call__(self, batch: Any) -> Any:
        kind = type(batch)
        if kind is torch.Tensor:
            return self._tensor(batch)
        if kind is tuple or kind is list:
            return kind(self._tensor(t) if type(t) is torch.Tensor else self(t) for t in batch)
        if kind is dict:
            return {k: self._tensor(v) if type(v) is torch.Tensor else self(v) for k, v in batch.items()}
        return self._fallback(batch)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or not tensor.dim():
            return self._fallback(tensor)
        return self._accelerator.copy_to_device(self.pool.pin(tensor), self.device)
