"""A host-memory copy of training state, taken in the blocking part of a background save.

Training goes on changing the parameters and optimizer state while a background save writes,
so the save first copies every tensor of the state into memory nothing else touches:
:func:`snapshot` walks the state (dicts, lists, tuples as ``torch.save`` sees them) and copies
each tensor storage once into a buffer of a :class:`HostBuffers` pool, keeping which tensors
shared a storage (tied weights stay tied in the file) and each tensor's view of it.

The pool is kept across saves: the second and later snapshots copy into memory already
touched (no page faults, no allocation), and tensors of a GPU go into *pinned* buffers, so
their copies run asynchronously with one synchronisation at the end. That pool is the
background save's memory cost: one host copy of the state (``HostBuffers.nbytes``). Only one
save uses it at a time (a save waits for the previous one before it snapshots).

DTensors (FSDP2 shards) become CPU DTensors over a copy of this rank's shard, with the same
mesh and placements: what ``torch.distributed.checkpoint`` needs to write them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["HostBuffers", "snapshot"]

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
              torch.memory_format, torch.layout)


class HostBuffers:
    """Host memory snapshots copy into, reused by the next snapshot of the same shapes."""

    def __init__(self) -> None:
        self._pool: list[torch.UntypedStorage] = []
        self._holders: list[Any] = []  # CPU DTensors around the host copies of shards

    @property
    def nbytes(self) -> int:
        """Host memory held between saves (one copy of the last state snapshotted)."""
        return sum(storage.nbytes() for storage in self._pool)

    def release(self) -> None:
        """Free the buffers (the next snapshot allocates again)."""
        self._pool.clear()
        self._holders.clear()

    def _take(self, index: int, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        """The pool's ``index``-th buffer, reused when its size and pinning fit, else replaced."""
        if index < len(self._pool):
            held = self._pool[index]
            if held.nbytes() == nbytes and held.is_pinned() == pinned:
                return held
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if index < len(self._pool):
            self._pool[index] = buffer
        else:
            self._pool.append(buffer)
        return buffer

    def _trim(self, used: int, holders: int) -> None:
        del self._pool[used:]
        del self._holders[holders:]


class _Snapshot:
    def __init__(self, buffers: HostBuffers) -> None:
        self.buffers = buffers
        self.copied: dict[tuple[str, int], torch.UntypedStorage] = {}  # (device, data_ptr) -> host copy
        self.devices: set[torch.device] = set()
        self.dtensors: dict[int, Any] = {}

    def storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        source = tensor.untyped_storage()
        key = (str(source.device), source.data_ptr())
        held = self.copied.get(key)
        if held is not None:
            return held
        from gpukit.accelerators import get_accelerator

        on_host = source.device.type == "cpu"
        pinned = not on_host and get_accelerator(source.device).benefits_from_pinned_memory
        held = self.buffers._take(len(self.copied), source.nbytes(), pinned)
        if source.nbytes():
            target = torch.empty(0, dtype=torch.uint8).set_(held)
            origin = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)
            target.copy_(origin, non_blocking=pinned)
            if not on_host:
                self.devices.add(source.device)
        self.copied[key] = held
        return held

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        dtensor = self._dtensor_type()
        if dtensor is not None and isinstance(tensor, dtensor):
            return self._dtensor(tensor)
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_sparse or tensor.is_quantized:
            return tensor.detach().to("cpu", copy=True)  # rare kinds: a plain copy, as torch.save would write it
        tensor = tensor.detach() if isinstance(tensor, nn.Parameter) or tensor.requires_grad else tensor
        if tensor.untyped_storage().data_ptr() == 0:  # no storage behind it (empty)
            out = torch.empty(tensor.shape, dtype=tensor.dtype)
        else:
            out = torch.empty(0, dtype=tensor.dtype).set_(
                self.storage(tensor), tensor.storage_offset(), tensor.size(), tensor.stride())
        return out

    def _dtensor_type(self) -> type | None:
        import sys

        module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
        return getattr(module, "DTensor", None) if module is not None else None

    def _dtensor(self, tensor: Any) -> Any:
        """A CPU DTensor with ``tensor``'s spec around a host copy of this rank's shard.

        As DCP's own staging does: a CPU DTensor of the same spec (made once, kept in the pool)
        whose local tensor is replaced by the copy. ``DTensor.from_local`` would move the copy
        back to the mesh's device.
        """
        local = self.tensor(tensor._local_tensor)
        index = len(self.dtensors)
        holders = self.buffers._holders
        holder = holders[index] if index < len(holders) else None
        if holder is None or holder._spec != tensor._spec or holder.dtype != tensor.dtype:
            holder = tensor.detach().to("cpu")
            if holder.device_mesh.device_type == "cpu":  # .to("cpu") returned the same DTensor: copy it
                holder = copy.deepcopy(holder)
            holders[index:index + 1] = [holder]
        holder._local_tensor = local
        self.dtensors[index] = holder
        return holder

    def walk(self, state: Any) -> Any:
        if isinstance(state, torch.Tensor):
            out = self.tensor(state)
            if isinstance(state, nn.Parameter):
                return nn.Parameter(out, requires_grad=state.requires_grad)
            if state.requires_grad and out.is_leaf and (out.is_floating_point() or out.is_complex()):
                out.requires_grad_(True)  # torch.save records it; loading gives it back
            return out
        if isinstance(state, Mapping):
            items = ((key, self.walk(value)) for key, value in state.items())
            out_map: dict[Any, Any] = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
            if hasattr(state, "_metadata"):
                out_map._metadata = copy.deepcopy(state._metadata)  # type: ignore[attr-defined]
            return out_map
        if isinstance(state, list):
            return [self.walk(value) for value in state]
        if isinstance(state, tuple):
            values = [self.walk(value) for value in state]
            return type(state)(*values) if hasattr(state, "_fields") else tuple(values)
        if isinstance(state, _IMMUTABLE):
            return state
        return copy.deepcopy(state)


def snapshot(state: Any, buffers: HostBuffers) -> tuple[Any, int]:
    """``state`` with every tensor copied into host memory from ``buffers``; returns it and the
    bytes copied. Returns once the copies are complete (device copies synchronised)."""
    walker = _Snapshot(buffers)
    with torch.no_grad():
        copied = walker.walk(state)
    from gpukit.accelerators import get_accelerator

    for device in walker.devices:
        get_accelerator(device).synchronize(device)
    buffers._trim(len(walker.copied), len(walker.dtensors))
    return copied, sum(storage.nbytes() for storage in walker.copied.values())
