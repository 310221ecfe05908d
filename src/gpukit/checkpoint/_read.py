"""Reading a checkpoint file whole or lazily, safely: what ``gpukit.load`` does without a model.

Kept apart from ``_io.py`` (which also saves, and loads into a model through ``_direct.py``) so that
the in-place loaders can read files without importing back into ``_io``.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from gpukit.accelerators import get_accelerator
from gpukit.checkpoint._dist import current_dist
from gpukit.checkpoint._formats import (
    SAFETENSORS,
    TORCH_LEGACY,
    TORCH_ZIP,
    check_readable_file,
    pickled_globals,
    read_safetensors_header,
    sniff_format,
)
from gpukit.checkpoint._lazy import LazyCheckpoint, open_lazy
from gpukit.checkpoint._record_sizes import check_record_sizes
from gpukit.errors import CheckpointError, GpukitError, UnsafeCheckpointError

__all__ = ["read_file", "load_lazy", "auto_map_location", "safetensors_module"]

# Messages of torch's weights-only unpickler that mean "this would run or import code".
_UNSAFE_PATTERNS = (
    r"Unsupported global: GLOBAL (?P<name>\S+)",
    r"Trying to load unsupported GLOBAL (?P<name>\S+)",
    r"Trying to call reduce for unrecognized function (?P<name>.+?)(?: which belongs|$)",
    r"Can only create new object for nn.Parameter or classes allowlisted via `add_safe_globals` but got (?P<name>.+)",
    r"Can only build Tensor, Parameter, OrderedDict or types allowlisted via `add_safe_globals`, but got (?P<name>.+)",
    r"(?P<name>``torch\.\S+``) must be imported",
)


def safetensors_module() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError(
            "Reading or writing .safetensors files needs the safetensors package, a dependency of gpukit "
            "missing from this environment: pip install safetensors."
        ) from None
    return st


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
    st = safetensors_module()
    read_safetensors_header(path, path.stat().st_size)  # refuses absurd sizes before anything is allocated
    device = "cpu" if map_location in (None, "auto") else str(map_location)
    try:
        return dict(st.load_file(str(path), device=device))
    except Exception as exc:  # safetensors raises its own SafetensorError for bad files
        raise CheckpointError(f"{path} is a damaged safetensors file: {_first_line(exc)}.") from None


def read_file(path: Path, map_location: Any = "auto", *, trust: bool = False, format: str | None = None) -> Any:
    """What :func:`gpukit.load` returns for ``path`` without a model (``format`` already checked)."""
    size = check_readable_file(path)
    detected = sniff_format(path, size)
    if format == "safetensors" or (format is None and detected == SAFETENSORS):
        return _load_safetensors(path, map_location)
    return _load_torch(path, map_location, trust)


def load_lazy(path: str | os.PathLike[str], *, trust: bool = False) -> LazyCheckpoint:
    """Open a checkpoint for restoring in place: tensors are read only when used, straight into
    the model's own tensors where they fit (see ``_lazy.py``). Same safety and errors as
    :func:`gpukit.load` with ``map_location="cpu"``; files it cannot open that way are read whole
    (``trust=True``: read whole with full unpickling, for files you trust).
    """
    source = Path(path)
    size = check_readable_file(source)
    if trust:
        return LazyCheckpoint(source, size, read_file(source, "cpu", trust=True))
    lazy = open_lazy(source, size, lambda p: _load_torch(p, "meta", trust=False))
    if lazy is None:
        lazy = LazyCheckpoint(source, size, read_file(source, "cpu"))
    return lazy
