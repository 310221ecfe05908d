"""After an out-of-memory nobody recovered from: what held the memory, and where it came from.

On CUDA the caching allocator's snapshot (``torch.cuda.memory._snapshot()``) is pickled to a
file that https://pytorch.org/memory_viz opens (drag the file onto the page), and the largest
live allocations are printed with the source line that made each of them -- source lines exist
only when allocation history was being recorded (:func:`record_memory_history`, which costs a
little on every allocation, so it is off by default). On the CPU there is no allocator snapshot;
the largest live tensors Python can see are listed instead.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from gpukit._util.envvars import OOM_DIR_ENV
from gpukit._util.units import format_bytes
from gpukit.accelerators import auto_device_type, get_accelerator
from gpukit.memory._live import live_tensors, storage_bytes, storage_key

__all__ = ["Allocation", "record_memory_history", "largest_allocations", "write_oom_snapshot", "oom_postmortem"]

# frames inside these files are the allocator's and torch's own; the user's line comes after
_INTERNAL = ("/torch/", "/site-packages/torch", "CUDACachingAllocator", "??", "<frozen")


@dataclass(frozen=True)
class Allocation:
    """A live allocation: its size and the call stack (innermost user frame first) that made it."""

    size_bytes: int
    frames: tuple[str, ...]

    @property
    def source(self) -> str | None:
        return self.frames[0] if self.frames else None


def record_memory_history(enabled: bool = True, max_entries: int = 100_000, device: str | torch.device | None = None) -> bool:
    """Start (or stop) recording allocation stack traces so a post-mortem can name source lines.

    Returns:
        Whether recording is now on (always ``False`` off CUDA, where there is nothing to record).
    """
    accelerator = get_accelerator(device if device is not None else auto_device_type())
    return accelerator.record_memory_history(enabled, max_entries)


def _user_frames(frames: list[dict[str, Any]]) -> tuple[str, ...]:
    """The Python frames outside torch, innermost first (else the first frames, for a hint).

    With C++ stacks recorded (``_record_memory_history("all")``, the default) a block's frames
    start with the allocator's and torch's C++ frames (``memory_snapshot.cpp``...): the user's
    line is the first *Python* frame outside torch.
    """
    lines = [f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}" for f in frames]
    python = [line for line, f in zip(lines, frames) if str(f.get("filename", "")).endswith(".py")]
    user = [line for line in python if not any(marker in line for marker in _INTERNAL)]
    return tuple(user or python[:3] or lines[:3])


def largest_allocations(snapshot: dict[str, Any], top: int = 10) -> list[Allocation]:
    """The ``top`` largest live blocks of an allocator snapshot (``torch.cuda.memory._snapshot()``)."""
    blocks = [
        block
        for segment in snapshot.get("segments", [])
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"
    ]
    blocks.sort(key=lambda block: block.get("requested_size", block.get("size", 0)), reverse=True)
    return [
        Allocation(int(block.get("requested_size", block.get("size", 0))), _user_frames(block.get("frames", [])))
        for block in blocks[:top]
    ]


def _default_path(directory: str | os.PathLike[str] | None) -> Path:
    folder = Path(directory if directory is not None else os.environ.get(OOM_DIR_ENV, "."))
    return folder / f"gpukit-oom-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.pickle"


def write_oom_snapshot(
    path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = None,
    top: int = 10,
    file: IO[str] | None = None,
) -> Path | None:
    """Write the allocator snapshot and print the largest allocations.

    Args:
        path: file to write; ``gpukit-oom-<pid>-<time>.pickle`` in ``$GPUKIT_OOM_DIR`` or the
            working directory by default.
        device: device that ran out of memory (the best available type by default).
        top: allocations (or, on the CPU, tensors) to list.
        file: where to print; standard error by default.

    Returns:
        The snapshot's path on CUDA; ``None`` on devices without an allocator snapshot.
    """
    out = file or sys.stderr
    accelerator = get_accelerator(device if device is not None else auto_device_type())
    snapshot = accelerator.allocator_snapshot()
    if snapshot is not None:
        target = Path(path) if path is not None else _default_path(None)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as handle:
            pickle.dump(snapshot, handle)
        print(f"gpukit: allocator snapshot written to {target} -- open it at https://pytorch.org/memory_viz", file=out)
        allocations = largest_allocations(snapshot, top)
        has_frames = any(a.frames for a in allocations)
        print(f"gpukit: largest live allocations on {accelerator.type}:", file=out)
        for allocation in allocations:
            print(f"  {format_bytes(allocation.size_bytes):>12}  {allocation.source or '(no stack recorded)'}", file=out)
        if not has_frames:
            print("gpukit: call gpukit.memory.record_memory_history() before training to see source lines.", file=out)
        return target
    print(
        f"gpukit: no allocator snapshot on {accelerator.type} (only CUDA has one); largest live CPU tensors:", file=out
    )
    seen: set[Any] = set()
    tensors = []
    for tensor in live_tensors():
        key = storage_key(tensor)
        if key is not None and key[0] == "cpu" and key not in seen:
            seen.add(key)
            tensors.append((storage_bytes(tensor), tuple(tensor.shape), tensor.dtype))
    tensors.sort(key=lambda item: item[0], reverse=True)
    for nbytes, shape, dtype in tensors[:top]:
        print(f"  {format_bytes(nbytes):>12}  {list(shape)} {str(dtype).replace('torch.', '')}", file=out)
    return None


@contextlib.contextmanager
def oom_postmortem(path: str | os.PathLike[str] | None = None, *, device: str | torch.device | None = None) -> Iterator[None]:
    """Write a post-mortem when the block raises out-of-memory, then let the error propagate.

    ``with oom_postmortem(): train()`` -- the snapshot is taken before the exception unwinds,
    while the tensors that filled the device are still alive.
    """
    accelerator = get_accelerator(device if device is not None else auto_device_type())
    try:
        yield
    except accelerator.oom_error_types():
        write_oom_snapshot(path, device=device)
        raise
