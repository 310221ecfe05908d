"""``save`` and ``load``: atomic writes, safe reads, checkpoints that load anywhere."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from torch import nn

from gpukit.checkpoint._atomic import atomic_write
from gpukit.checkpoint._background import SaveTimings, background_saves
from gpukit.checkpoint._dist import DistContext, background_dist, current_dist
from gpukit.checkpoint._gather import gather_sharded
from gpukit.checkpoint._formats import (
    append_zip_metadata,
    check_format,
    format_for_save,
    metadata_entry,
    safetensors_metadata,
)
from gpukit.checkpoint._direct import load_state_dict
from gpukit.checkpoint._snapshot import snapshot
from gpukit.checkpoint._zipwrite import write_torch_zip
from gpukit.checkpoint._prefixes import strip_wrapper_prefixes
from gpukit.checkpoint._read import read_file, safetensors_module
from gpukit.errors import CheckpointError, ConfigurationError

__all__ = ["save", "load", "to_saveable"]

#: torch's serializer is reachable, so torch files go through gpukit's writer (_zipwrite.py)
_OWN_WRITER = hasattr(torch.serialization, "_save")

def to_saveable(state: Any) -> Any:
    """``state`` with models and other stateful objects replaced by their state dicts.

    Models (wrapped or not) give unwrapped, prefix-free state dicts; optimizers, schedulers,
    scalers and loaders give ``state_dict()``, so the file loads with ``weights_only=True``.
    Dicts, lists and tuples are walked; everything else is kept as is.
    """
    from gpukit.placement import unwrap_model

    if isinstance(state, nn.Module):
        return strip_wrapper_prefixes(unwrap_model(state).state_dict())
    if not isinstance(state, (torch.Tensor, Mapping, type)) and callable(getattr(state, "state_dict", None)):
        return to_saveable(state.state_dict())
    if isinstance(state, Mapping):
        items = ((key, to_saveable(value)) for key, value in state.items())
        out: dict[Any, Any] = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        if hasattr(state, "_metadata"):  # module versions that load_state_dict reads
            out._metadata = state._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(state, list):
        return [to_saveable(value) for value in state]
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return tuple(to_saveable(value) for value in state)
    return state


def _safetensors_tensors(state: Any, path: Path) -> dict[str, torch.Tensor]:
    """The flat name -> tensor mapping safetensors stores, with shared storage made separate."""
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        bad = sorted(str(k) for k, v in state.items() if not isinstance(v, torch.Tensor)) if isinstance(
            state, Mapping) else [type(state).__name__]
        raise ConfigurationError(
            f"safetensors stores a flat mapping of names to tensors, but the state for {path} has "
            f"other entries: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}. Save model weights "
            "only (gpukit.save(model, path)) or use format='torch' for training state."
        )
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for key, tensor in state.items():
        tensor = tensor.detach()
        storage_id = (str(tensor.device), tensor.untyped_storage().data_ptr())
        # Tied weights share storage; safetensors refuses that, so they are stored twice.
        tensor = tensor.clone() if storage_id in seen else tensor.contiguous()
        seen.add(storage_id)
        tensors[str(key)] = tensor
    return tensors


def _write_torch(state: Any) -> Callable[[BinaryIO], None]:
    def write(handle: BinaryIO) -> None:
        if _OWN_WRITER:
            handle.flush()
            raw = getattr(handle, "raw", None)  # atomic_write's guarded file: it keeps the OS error
            guarded = hasattr(raw, "pwrite")
            size = write_torch_zip(raw.pwrite if guarded else handle.fileno(), state, metadata_entry(),
                                   pwritev=raw.pwritev if guarded else None)
            handle.seek(size)  # the end (pwrite leaves the position alone): a reused file is cut here
            return
        torch.save(state, handle)
        append_zip_metadata(handle, metadata_entry())

    return write


def _write_safetensors(tensors: dict[str, torch.Tensor]) -> Callable[[BinaryIO], None]:
    def write(handle: BinaryIO) -> None:
        handle.write(safetensors_module().save(tensors, metadata=safetensors_metadata()))

    return write


def _save_here(state: Any, path: Path, format: str, reuse: Path | None = None) -> None:
    """Write ``state`` to ``path`` atomically (overwriting the file ``reuse`` in place if given)."""
    saveable = to_saveable(state)
    if format == "safetensors":
        atomic_write(path, _write_safetensors(_safetensors_tensors(saveable, path)))
    else:
        # only gpukit's writer (pwrite at known offsets, then cut) can overwrite a file in place
        atomic_write(path, _write_torch(saveable), reuse=reuse if _OWN_WRITER else None)


def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    rank_zero_only: bool = True,
    background: bool = False,
) -> Path:
    """Save ``state`` to ``path`` atomically: a crash leaves the old file or the new one.

    Models anywhere in ``state`` (plain or wrapped by DataParallel, DDP, torch.compile) are
    saved as state dicts without ``module.`` / ``_orig_mod.`` prefixes. Under an initialised
    ``torch.distributed`` process group only rank 0 writes and the others wait for it.

    Args:
        state: a model, a state dict, or any nesting of dicts/lists/tuples of tensors, models,
            numbers and strings (what ``torch.load(weights_only=True)`` can read back).
        path: the file to write; its directory is created if missing.
        format: ``"torch"`` or ``"safetensors"``; by default ``.safetensors`` files get
            safetensors (tensors only), everything else torch's zip format.
        rank_zero_only: under torch.distributed, write on rank 0 only (every rank returns once
            it is written). ``False`` makes every rank write its own ``path``.
        background: return once ``state`` is copied to host memory and write the file in a
            background thread (one save in flight at a time; a failure is raised by the next
            save or :func:`~gpukit.checkpoint.wait_for_saves`). See docs/checkpoints.md.

    Returns:
        The path written (with ``background``: where the file will be once written).

    Raises:
        CheckpointError: the write failed (disk full, no permission...); the previous file at
            ``path`` is unchanged.
        ConfigurationError: an unknown ``format``, or non-tensor state for safetensors.
        CheckpointError: also when, under several processes with ``rank_zero_only``, not every
            rank called it (``if rank == 0: gpukit.save(...)``): it is collective.
    """
    target = Path(path)
    fmt = format_for_save(target, format)
    dist = current_dist()
    if background:
        return _save_in_background(state, target, fmt, dist, collective=rank_zero_only and dist.world_size > 1)
    timings = SaveTimings(str(target), False)
    background_saves().last = timings  # last_save_timings() speaks of this save from now on
    started = time.perf_counter()
    try:
        return _save_now(state, target, fmt, dist, rank_zero_only)
    finally:
        timings.blocked_s = timings.total_s = timings.write_s = time.perf_counter() - started


def _save_now(state: Any, target: Path, fmt: str, dist: DistContext, rank_zero_only: bool) -> Path:
    """``save`` without ``background``: every rank returns once the file is complete (or raises)."""
    # FSDP-sharded models become full tensors, gathered by every rank: rank 0's shards alone
    # would be silent data loss
    if not rank_zero_only or dist.world_size == 1:
        _save_here(gather_sharded(state, everywhere=True), target, fmt)
        return target
    dist.check_all_arrived("gpukit.save")
    state = gather_sharded(state, everywhere=False)  # after the check: a rank missing would hang it
    failure: BaseException | None = None
    if dist.is_main:
        try:
            _save_here(state, target, fmt)
        except Exception as exc:  # every rank must hear of it, or they wait forever
            failure = exc
    reason = dist.broadcast_from_main(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if reason is not None:
        raise CheckpointError(f"Rank 0 failed to save {target}: {reason}")
    return target


def _save_in_background(state: Any, target: Path, fmt: str, dist: DistContext, *, collective: bool) -> Path:
    """``save(..., background=True)``: gather and copy on this thread, write in the background."""
    started = time.perf_counter()
    if collective:
        dist.check_all_arrived("gpukit.save")
    saves = background_saves()
    waited = saves.wait()  # one in flight; its failure surfaces here
    state = gather_sharded(state, everywhere=not collective)
    writes = not collective or dist.is_main
    timings = SaveTimings(str(target), True, waited_s=waited)
    copied = time.perf_counter()
    host, timings.host_bytes = snapshot(to_saveable(state), saves.buffers) if writes else (None, 0)
    timings.snapshot_s = time.perf_counter() - copied
    writer = background_dist(dist) if collective else None

    def work() -> None:
        failure: BaseException | None = None
        if writes:
            try:
                _save_here(host, target, fmt)
            except Exception as exc:  # every rank must hear of it
                failure = exc
        reason = writer.broadcast_from_main(None if failure is None else str(failure)) if writer else None
        if failure is not None:
            raise failure
        if reason is not None:
            raise CheckpointError(f"Rank 0 failed to save {target}: {reason}")

    timings.blocked_s = time.perf_counter() - started
    saves.submit(timings, work)
    return target


def load(
    path: str | os.PathLike[str],
    map_location: Any = "auto",
    *,
    trust: bool = False,
    format: str | None = None,
    model: nn.Module | None = None,
    strict: bool = True,
) -> Any:
    """Load a checkpoint safely, on whatever devices this machine has.

    Args:
        path: a file written by :func:`save`, ``torch.save`` or safetensors.
        map_location: ``"auto"`` keeps each tensor on the device it was saved from when that
            device exists here and puts it on the CPU otherwise (a GPU checkpoint loads on a
            CPU-only machine); under torch.distributed GPU tensors go to each rank's current
            GPU, not all to the GPU they were saved from; anything else is passed to ``torch.load`` (e.g. ``"cpu"``).
        trust: allow full unpickling, which can run code hidden in the file. Only for files
            from a source you trust; the default refuses them with UnsafeCheckpointError.
        format: ``"torch"`` or ``"safetensors"``; detected from the file's bytes by default.
        model: load the file's state dict into this model instead of returning it: each tensor
            is read from the file straight into the model's own (wherever the model lives), not
            into new memory first (``gpukit.load_state_dict(model, path)``; ``strict`` as there).

    Returns:
        What was saved (state dicts, tensors, nested containers); with ``model``, what
        ``load_state_dict`` returns (missing and unexpected keys).

    Raises:
        CheckpointError: missing, empty, truncated, corrupted or unreadable file, or a directory.
        UnsafeCheckpointError: the file needs full unpickling and ``trust`` is False.
    """
    source = Path(path)
    check_format(format)
    if model is not None:
        if map_location != "auto":
            raise ConfigurationError(f"gpukit.load(path, model=..., map_location={map_location!r}): with a model the "
                                     "tensors go where the model's are; leave map_location out (or move the model).")
        return load_state_dict(model, source, strict, trust=trust)
    return read_file(source, map_location, trust=trust, format=format)
