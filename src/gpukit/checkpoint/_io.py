"""``save`` and ``load``: atomic writes, safe reads, checkpoints that load anywhere."""

from __future__ import annotations

import os
import pickle
import re
import time
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from torch import nn

from gpukit.accelerators import get_accelerator
from gpukit.checkpoint._atomic import atomic_write
from gpukit.checkpoint._background import SaveTimings, background_saves
from gpukit.checkpoint._dist import DistContext, background_dist, current_dist
from gpukit.checkpoint._gather import gather_sharded
from gpukit.checkpoint._formats import (
    SAFETENSORS,
    TORCH_LEGACY,
    TORCH_ZIP,
    append_zip_metadata,
    check_readable_file,
    format_for_save,
    metadata_entry,
    pickled_globals,
    read_safetensors_header,
    safetensors_metadata,
    sniff_format,
)
from gpukit.checkpoint._lazy import LazyCheckpoint, open_lazy
from gpukit.checkpoint._snapshot import snapshot
from gpukit.checkpoint._zipwrite import write_torch_zip
from gpukit.checkpoint._prefixes import strip_wrapper_prefixes
from gpukit.checkpoint._record_sizes import check_record_sizes
from gpukit.errors import CheckpointError, ConfigurationError, GpukitError, UnsafeCheckpointError

__all__ = ["save", "load", "load_lazy", "to_saveable", "auto_map_location"]

# Messages of torch's weights-only unpickler that mean "this would run or import code".
_UNSAFE_PATTERNS = (
    r"Unsupported global: GLOBAL (?P<name>\S+)",
    r"Trying to load unsupported GLOBAL (?P<name>\S+)",
    r"Trying to call reduce for unrecognized function (?P<name>.+?)(?: which belongs|$)",
    r"Can only create new object for nn.Parameter or classes allowlisted via `add_safe_globals` but got (?P<name>.+)",
    r"Can only build Tensor, Parameter, OrderedDict or types allowlisted via `add_safe_globals`, but got (?P<name>.+)",
    r"(?P<name>``torch\.\S+``) must be imported",
)


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


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError(
            "Reading or writing .safetensors files needs the safetensors package, a dependency of gpukit "
            "missing from this environment: pip install safetensors."
        ) from None
    return st


def _write_torch(state: Any) -> Callable[[BinaryIO], None]:
    def write(handle: BinaryIO) -> None:
        if hasattr(torch.serialization, "_save"):  # torch's serializer, gpukit's writer (_zipwrite.py)
            handle.flush()
            raw = getattr(handle, "raw", None)  # atomic_write's guarded file: it keeps the OS error
            write_torch_zip(raw.pwrite if hasattr(raw, "pwrite") else handle.fileno(), state, metadata_entry())
            return
        torch.save(state, handle)
        append_zip_metadata(handle, metadata_entry())

    return write


def _write_safetensors(tensors: dict[str, torch.Tensor]) -> Callable[[BinaryIO], None]:
    def write(handle: BinaryIO) -> None:
        handle.write(_safetensors().save(tensors, metadata=safetensors_metadata()))

    return write


def _save_here(state: Any, path: Path, format: str) -> None:
    saveable = to_saveable(state)
    if format == "safetensors":
        atomic_write(path, _write_safetensors(_safetensors_tensors(saveable, path)))
    else:
        atomic_write(path, _write_torch(saveable))


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


def auto_map_location(storage: Any, location: str) -> Any:
    """``map_location`` that keeps the saved device when it exists here, else uses the CPU.

    Under ``torch.distributed`` a GPU tensor goes to this rank's current GPU instead: every
    rank loading a checkpoint saved from ``cuda:0`` onto ``cuda:0`` would put all of them on
    the first GPU (the classic "extra processes on GPU 0" out-of-memory).

    Returns ``None`` (torch's default placement) for available devices, else the CPU storage.
    """
    try:
        device = torch.device(location)
        accelerator = get_accelerator(device)
    except (RuntimeError, GpukitError):
        return storage  # a device type this build does not know: keep it on the CPU
    if not accelerator.is_available() or accelerator.device_count() == 0:
        return storage
    if not accelerator.is_host and current_dist().world_size > 1:
        return storage.to(device=accelerator.current_device())
    if (device.index or 0) < accelerator.device_count():
        return None
    return storage


def _unsafe_reason(message: str) -> str | None:
    for pattern in _UNSAFE_PATTERNS:
        match = re.search(pattern, message)
        if match:
            return match.group("name").strip()
    return None


def _load_torch(path: Path, map_location: Any, trust: bool) -> Any:
    location = auto_map_location if map_location == "auto" else map_location
    if not trust and sniff_format(path, path.stat().st_size) == TORCH_ZIP:
        check_record_sizes(path)  # torch 2.5 reads a short record as garbage, without a word
    try:
        with warnings.catch_warnings():  # torch's note on a legacy file's pickle protocol is no use here
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=location, weights_only=not trust)
    except pickle.UnpicklingError as exc:
        name = _unsafe_reason(str(exc))
        if name is None:  # an opcode the weights-only reader lacks: is it hiding globals?
            with open(path, "rb") as head:
                found = pickled_globals(path, TORCH_ZIP if head.read(2) == b"PK" else TORCH_LEGACY)
            name = ", ".join(found[:5]) if found else None
        if name is not None:
            raise UnsafeCheckpointError(
                f"Refused to load {path}: it contains pickled Python objects ({name}) and unpickling "
                "them can run arbitrary code. Nothing was executed. If you trust the file's source, "
                "load it with gpukit.load(path, trust=True); to allow only specific classes, use "
                "torch.serialization.safe_globals([...]) around gpukit.load."
            ) from None
        raise CheckpointError(
            f"{path} is corrupted: its pickled data cannot be read ({_unpickler_detail(str(exc))}). "
            "Use an older checkpoint or copy the file again."
        ) from None
    except Exception as exc:  # whatever a damaged file makes torch raise (IndexError, ...): say so plainly
        if isinstance(exc, GpukitError):
            raise
        if "deserialize object on" in str(exc):
            raise CheckpointError(
                f"Cannot place the tensors of {path} with map_location={map_location!r}: "
                f"{_first_line(exc)}. Use map_location='auto' or 'cpu'."
            ) from None
        raise CheckpointError(
            f"{path} is truncated or corrupted and cannot be loaded ({type(exc).__name__}: "
            f"{_first_line(exc)}). Use an older checkpoint or copy the file again."
        ) from None


def _unpickler_detail(message: str) -> str:
    """The weights-only unpickler's own words, without torch's advice to disable it."""
    _, _, detail = message.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    return lines[0][:300] if lines else "unreadable pickle data"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _load_safetensors(path: Path, map_location: Any) -> dict[str, torch.Tensor]:
    st = _safetensors()
    read_safetensors_header(path, path.stat().st_size)  # refuses absurd sizes before anything is allocated
    device = "cpu" if map_location in (None, "auto") else str(map_location)
    try:
        return dict(st.load_file(str(path), device=device))
    except Exception as exc:  # safetensors raises its own SafetensorError for bad files
        raise CheckpointError(f"{path} is a damaged safetensors file: {_first_line(exc)}.") from None


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
    if format is not None and format not in ("torch", "safetensors"):
        raise ConfigurationError(f"Unknown checkpoint format {format!r}; use 'torch' or 'safetensors'.")
    if model is not None:
        if map_location != "auto":
            raise ConfigurationError(f"gpukit.load(path, model=..., map_location={map_location!r}): with a model the "
                                     "tensors go where the model's are; leave map_location out (or move the model).")
        from gpukit.checkpoint._prefixes import load_state_dict

        return load_state_dict(model, source, strict, trust=trust)
    size = check_readable_file(source)
    detected = sniff_format(source, size)
    if format == "safetensors" or (format is None and detected == SAFETENSORS):
        return _load_safetensors(source, map_location)
    return _load_torch(source, map_location, trust)


def load_lazy(path: str | os.PathLike[str], *, trust: bool = False) -> LazyCheckpoint:
    """Open a checkpoint for restoring in place: tensors are read only when used, straight into
    the model's own tensors where they fit (see ``_lazy.py``). Same safety and errors as
    :func:`load` with ``map_location="cpu"``; files it cannot open that way are read whole
    (``trust=True``: read whole with full unpickling, for files you trust).
    """
    source = Path(path)
    size = check_readable_file(source)
    if trust:
        return LazyCheckpoint(source, size, load(source, map_location="cpu", trust=True))
    lazy = open_lazy(source, size, lambda p: _load_torch(p, "meta", trust=False))
    if lazy is None:
        lazy = LazyCheckpoint(source, size, load(source, map_location="cpu"))
    return lazy
