"""The tuning cache: chosen loader settings per (dataset fingerprint, batch size, machine).

One JSON file, ``$GPUKIT_CACHE_DIR/loader_tuning.json`` (default ``~/.cache/gpukit``), written
atomically under a file lock; a cache that cannot be read or written only means tuning again.
``GPUKIT_RETUNE=1`` ignores what is cached (and replaces it with the new measurement); an
entry whose choice a real epoch contradicts is dropped (``_forget_cache``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpukit._util.envvars import CACHE_DIR_ENV, RETUNE_ENV
from gpukit.data._loader_settings import LoaderSettings
from gpukit.data._workers import usable_cpu_count
from gpukit.errors import GpukitError

__all__ = ["RETUNE_ENV", "cache_dir", "cache_file", "dataset_fingerprint"]

_CACHE_FILE = "loader_tuning.json"

def cache_dir() -> Path:
    """Where gpukit caches results per machine: ``$GPUKIT_CACHE_DIR`` or ``~/.cache/gpukit``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpukit"


def cache_file() -> Path:
    """The tuning cache file."""
    return cache_dir() / _CACHE_FILE


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


def _read_cache(key: str) -> tuple[LoaderSettings, float | None] | None:
    """The cached settings of ``key`` and the batches/s they were measured at (if recorded)."""
    try:
        entry = json.loads(cache_file().read_text()).get(key)
        if not entry:
            return None
        rate = entry.get("batches_per_s")
        return LoaderSettings(**entry["settings"]), float(rate) if isinstance(rate, (int, float)) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # no cache yet, or an unreadable one: measure


def _write_cache(key: str, settings: LoaderSettings | None, batches_per_s: float | None = None) -> None:
    """Store ``settings`` (measured at ``batches_per_s``) under ``key`` (``None``: remove it)."""
    from gpukit._util.safe_files import exclusive_lock
    from gpukit.checkpoint import atomic_write

    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # never follows a planted symlink, never truncates or chmods (GPUKIT_CACHE_DIR may be shared)
        with exclusive_lock(path.with_name(path.name + ".lock"), timeout_s=10):
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError):
                entries = {}
            if not isinstance(entries, dict):
                entries = {}
            if settings is None:
                if entries.pop(key, None) is None:
                    return
            else:
                entries[key] = {"settings": asdict(settings), "batches_per_s": batches_per_s,
                                "time": time.time()}
            data = json.dumps(entries, indent=1).encode()
            atomic_write(path, lambda f: f.write(data))
    except (OSError, GpukitError, TimeoutError):
        pass  # a cache that cannot be written only means tuning again next time


def _forget_cache(key: str) -> None:
    """Remove ``key``'s entry: the next ``num_workers="tune"`` measures again."""
    _write_cache(key, None)
