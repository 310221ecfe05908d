"""The tuning cache: chosen loader settings per (dataset fingerprint, batch size, machine).

One JSON file, ``$GPUKIT_CACHE_DIR/loader_tuning.json`` (default ``~/.cache/gpukit``), written
atomically under a file lock; a cache that cannot be read or written only means tuning again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import TensorDataset

from gpukit.data._workers import usable_cpu_count
from gpukit.errors import GpukitError

if TYPE_CHECKING:
    from gpukit.data._tune import LoaderSettings

__all__ = ["cache_dir", "dataset_fingerprint"]

_CACHE_FILE = "loader_tuning.json"


def cache_dir() -> Path:
    """Where gpukit caches results per machine: ``$GPUKIT_CACHE_DIR`` or ``~/.cache/gpukit``."""
    env = os.environ.get("GPUKIT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpukit"


def dataset_fingerprint(dataset: Any) -> str:
    """Type, length and the first item's structure (shapes and dtypes) of ``dataset``."""
    parts = [f"{type(dataset).__module__}.{type(dataset).__qualname__}"]
    try:
        parts.append(f"len={len(dataset)}")
    except TypeError:
        pass
    if isinstance(dataset, TensorDataset):
        parts += [f"{tuple(t.shape)}:{t.dtype}" for t in dataset.tensors]
    else:
        try:
            first = dataset[0]
        except Exception:  # noqa: BLE001 - an unreadable first item: fingerprint without it
            first = None
        parts.append(_structure(first))
    return "|".join(parts)


def _structure(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor{tuple(obj.shape)}:{obj.dtype}"
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):  # numpy
        return f"array{tuple(obj.shape)}:{obj.dtype}"
    if isinstance(obj, (list, tuple)):
        return "(" + ",".join(_structure(o) for o in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k}:{_structure(v)}" for k, v in sorted(obj.items(), key=str)) + "}"
    return type(obj).__name__


def _cache_key(dataset: Any, batch_size: int, step_fn: Any, device: torch.device | None,
               local_world_size: int, cap: int) -> str:
    machine = [platform.node(), platform.machine(), str(usable_cpu_count()), str(local_world_size),
               str(cap), str(device.type if device is not None else None), torch.__version__]
    step = getattr(step_fn, "__qualname__", type(step_fn).__name__) if step_fn is not None else ""
    text = "\n".join([dataset_fingerprint(dataset), f"batch_size={batch_size}", step, *machine])
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cache(key: str) -> LoaderSettings | None:
    try:
        from gpukit.data._tune import LoaderSettings

        entry = json.loads((cache_dir() / _CACHE_FILE).read_text()).get(key)
        return LoaderSettings(**entry["settings"]) if entry else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # no cache yet, or an unreadable one: measure


def _write_cache(key: str, settings: LoaderSettings) -> None:
    from filelock import FileLock

    from gpukit.checkpoint._atomic import atomic_write

    path = cache_dir() / _CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=10):
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError):
                entries = {}
            entries[key] = {"settings": asdict(settings), "time": time.time()}
            data = json.dumps(entries, indent=1).encode()
            atomic_write(path, lambda f: f.write(data))
    except (OSError, GpukitError, TimeoutError):
        pass  # a cache that cannot be written only means tuning again next time
