"""What is in a checkpoint, and converting one (the library side of ``gpukit ckpt``).

Inspection never runs code from the file: torch files are read with ``weights_only=True``
(memory-mapped, so large files are not read in full), safetensors through its header, and a
file that needs full unpickling is reported with the Python globals it would import.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gpukit._util.units import whole_number
from gpukit.checkpoint._formats import (
    MARKER_NAME,
    SAFETENSORS,
    SAFETENSORS_DTYPES,
    TORCH_ZIP,
    check_readable_file,
    format_for_save,
    header_metadata,
    pickled_globals,
    read_metadata,
    read_safetensors_header,
    sniff_format,
)
from gpukit.checkpoint._io import load, save
from gpukit.checkpoint._keys import format_indices
from gpukit.checkpoint._manager import SHARED_FILE, CheckpointManager, rank_file_name
from gpukit.checkpoint._merge import describe_sharded, merge_sharded
from gpukit.checkpoint._prefixes import detect_prefixes, strip_wrapper_prefixes
from gpukit.checkpoint._resume_checks import check_step_files, read_marker
from gpukit.checkpoint._sharded import is_sharded_checkpoint, sharded_names
from gpukit.checkpoint._untrusted import check_output
from gpukit.errors import CheckpointError, ConfigurationError, UnsafeCheckpointError

__all__ = ["inspect_checkpoint", "convert_checkpoint", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_LIST_ALL_UP_TO = 40  # tensors; beyond this, numbered keys are folded into groups
_MAX_ENTRIES = 60


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) for every leaf in nested dicts/lists/tuples."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{prefix}{key}.")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj):
        for index, value in enumerate(obj):
            yield from _walk(value, f"{prefix}{index}.")
    else:
        yield prefix[:-1], obj


def _tensor_entries(tensors: list[tuple[str, list[int], str, str]]) -> list[dict[str, Any]]:
    """One entry per tensor, or per group of numbered keys with equal shape/dtype/device."""
    if len(tensors) <= _LIST_ALL_UP_TO:
        return [{"key": k, "count": 1, "shape": s, "dtype": d, "device": dev} for k, s, d, dev in tensors]
    groups: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
    for key, shape, dtype, device in tensors:
        parts = key.split(".")
        numbers = [whole_number(p) if p.isascii() else None for p in parts]  # hostile keys: '²', 5000 digits
        pattern = tuple("#" if n is not None else p for p, n in zip(parts, numbers))
        groups.setdefault((pattern, tuple(shape), dtype, device), []).append(
            tuple(n for n in numbers if n is not None))
    entries = []
    for (pattern, shape, dtype, device), numbers in groups.items():
        columns = iter(list(zip(*numbers)))
        key = ".".join(format_indices(next(columns)) if p == "#" else p for p in pattern)
        entries.append({"key": key, "count": len(numbers), "shape": list(shape), "dtype": dtype, "device": device})
    return entries


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        keys = set(value)
        if value and all(isinstance(v, torch.Tensor) for v in value.values()):
            numel = sum(v.numel() for v in value.values())
            return f"state dict: {len(value)} tensors, {numel:,} elements"
        if {"state", "param_groups"} <= keys:
            names = sorted({n for s in value["state"].values() if isinstance(s, dict) for n in s})
            return (f"optimizer: {len(value['param_groups'])} param group(s), state for "
                    f"{len(value['state'])} param(s) ({', '.join(names) or 'none'})")
        if {"last_epoch", "base_lrs"} <= keys:
            return f"LR scheduler: last_epoch={value['last_epoch']}"
        if {"scale", "growth_factor"} <= keys:
            return f"GradScaler: scale={value['scale']}"
        if {"epoch", "samples_consumed"} <= keys:  # a gpukit loader's: carries over to any number of ranks
            return (f"data position: epoch {value['epoch']}, {value['samples_consumed']} sample(s) of its order "
                    f"consumed ({value.get('batches_consumed')} batch(es) per rank)")
        if {"epoch", "batches_consumed"} <= keys:
            return f"data position: epoch {value['epoch']}, {value['batches_consumed']} batch(es) consumed"
        if {"python", "torch"} <= keys:
            return "RNG states: " + ", ".join(k if not isinstance(value[k], list) else f"{k} ({len(value[k])} devices)"
                                              for k in value)
        shown = ", ".join(map(str, list(value)[:8]))
        return f"dict: {shown}{', ...' if len(value) > 8 else ''}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _inspect_file(path: Path) -> tuple[dict[str, Any], Any]:
    """(report, loaded state or None) for one file."""
    size = check_readable_file(path)
    fmt = sniff_format(path, size)
    header = read_safetensors_header(path, size) if fmt == SAFETENSORS else None  # parsed once
    meta = (header_metadata(header) if header is not None else read_metadata(path, fmt)) or {}
    info: dict[str, Any] = {
        "path": str(path), "format": fmt, "size_bytes": size,
        "torch_version": meta.get("torch_version", "unknown"),
        "gpukit_version": meta.get("gpukit_version"), "saved_at": meta.get("saved_at"), "unsafe": None,
    }
    locations: dict[int, str] = {}
    if header is not None:  # the (validated) header says it all; no tensor is read
        rows = [(k, list(v["shape"]), SAFETENSORS_DTYPES[v["dtype"]][0], "not stored")
                for k, v in sorted(header.items()) if k != "__metadata__"]
        state: Any = None
    else:
        def record(storage: Any, location: str) -> Any:
            locations[storage.data_ptr()] = location
            return storage

        try:
            with warnings.catch_warnings():  # torch's note on a legacy file's pickle protocol
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                state = torch.load(path, map_location=record, weights_only=True, mmap=fmt == TORCH_ZIP)
        except Exception:
            try:
                state = load(path, map_location="cpu")
            except UnsafeCheckpointError as exc:
                info["unsafe"] = str(exc).split(" Nothing was executed.")[0]
                info["pickled_globals"] = pickled_globals(path, fmt)
                return info, None
        rows = [(k, list(v.shape), str(v.dtype).removeprefix("torch."),
                 locations.get(v.untyped_storage().data_ptr(), "cpu"))
                for k, v in _walk(state) if isinstance(v, torch.Tensor)]
    counts_dtype, counts_device = Counter(r[2] for r in rows), Counter(r[3] for r in rows)
    numel = sum(int(torch.Size(r[1]).numel()) for r in rows)
    info["tensors"] = {"count": len(rows), "numel": numel, "dtypes": dict(counts_dtype),
                       "devices": dict(counts_device)}
    entries = _tensor_entries(rows)
    info["keys"] = entries[:_MAX_ENTRIES]
    info["keys_not_shown"] = sum(e["count"] for e in entries[_MAX_ENTRIES:])
    info["prefixes"] = detect_prefixes(k for k, *_ in rows)
    if isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        info["contents"] = {str(k): _describe(v) for k, v in state.items()}
    elif state is not None or fmt == SAFETENSORS:
        info["contents"] = {"": "state dict (tensors only)"}
    return info, state


def inspect_checkpoint(path: str | os.PathLike[str], *, trust: bool = False) -> dict[str, Any]:
    """A JSON-ready description of a checkpoint file or a CheckpointManager directory.

    Args:
        path: a checkpoint file, a step directory, or the directory holding the steps.
        trust: unpickle a sharded step's index (``.metadata``) freely instead of through the
            restricted unpickler (only for checkpoints you trust). Files are never unpickled.

    Raises:
        CheckpointError: the path is missing, unreadable or not a checkpoint.
        UnsafeCheckpointError: a shard index pickles anything but DCP metadata.
    """
    target = Path(path)
    if not target.is_dir():
        return _inspect_file(target)[0]
    step_dir = target if os.path.lexists(target / MARKER_NAME) else CheckpointManager(target).latest()
    if step_dir is None:
        raise CheckpointError(f"{target} is a directory without a complete gpukit checkpoint; give a file path.")
    marker, problem = read_marker(step_dir)
    if marker is None:
        raise CheckpointError(f"{step_dir} is an incomplete or damaged checkpoint: {problem}.")
    missing = [name for name in (SHARED_FILE, rank_file_name(0)) if name not in marker["files"]]
    if missing:
        raise CheckpointError(
            f"{step_dir} is an incomplete checkpoint: {' and '.join(missing)} missing (a step directory holds "
            f"{SHARED_FILE}, one rank_NNNNN.pt per process and {MARKER_NAME}). Use another step, or copy "
            "the whole directory again."
        )
    info, shared = _inspect_file(step_dir / SHARED_FILE)
    size_bytes = sum(int(s) for s in marker["files"].values())
    if info.get("unsafe"):  # state.pt needs full unpickling: report that, load nothing
        info.update(path=str(step_dir), format="gpukit-checkpoint-directory", size_bytes=size_bytes)
        return info
    rank0 = load(step_dir / rank_file_name(0), map_location="cpu")
    check_step_files(step_dir, shared, rank0)
    info.update(path=str(step_dir), format="gpukit-checkpoint-directory", size_bytes=size_bytes)
    info["checkpoint"] = {"step": marker["step"], "world_size": marker["world_size"], "files": marker["files"],
                          "extra": shared["gpukit"].get("extra", {})}
    contents = {name: _describe(value) for name, value in shared["objects"].items()}
    contents.update({f"{name} (per rank)": _describe(v) for name, v in rank0["objects"].items()})
    contents["rng (per rank)"] = _describe(rank0["rng"])
    if is_sharded_checkpoint(step_dir):  # FSDP objects live in the DCP shards, not in state.pt
        info["sharded"] = describe_sharded(step_dir, int(marker["world_size"]), trust)
        contents.update({f"{n} (sharded)": f"{o['kind']}, {o['tensors']} tensors, {o['numel']:,} elements"
                         for n, o in info["sharded"]["objects"].items()})
        _count_sharded(info["tensors"], info["sharded"]["objects"])
    info["contents"] = contents
    return info


def _count_sharded(tensors: dict[str, Any], objects: dict[str, dict[str, Any]]) -> None:
    """Add the tensors of the shards (counted from the shard index) to ``tensors``."""
    for entry in objects.values():
        tensors["count"] += entry["tensors"]
        tensors["numel"] += entry["numel"]
        for dtype, count in entry["dtypes"].items():
            tensors["dtypes"][dtype] = tensors["dtypes"].get(dtype, 0) + count
        tensors["devices"]["sharded"] = tensors["devices"].get("sharded", 0) + entry["tensors"]


def _map_tensors(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    return obj


def _strip_all(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            return strip_wrapper_prefixes(obj)
        return {k: _strip_all(v) for k, v in obj.items()}
    return obj


def _is_manager_file(state: Any) -> bool:
    """A CheckpointManager step file: ``{"objects", "gpukit"}`` (shared) or ``{"objects", "rng", "rank"}``."""
    return isinstance(state, dict) and isinstance(state.get("objects"), dict) and (
        "gpukit" in state or {"rng", "rank"} <= set(state))


def convert_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    strip_prefix: bool = False,
    to_cpu: bool = False,
    dtype: str | None = None,
    format: str | None = None,
    select: str | None = None,
    trust: bool = False,
) -> dict[str, Any]:
    """Read ``source``, transform it, and write ``target`` atomically.

    Args:
        source: a checkpoint file, a CheckpointManager step directory (its shared state), or
            the directory holding the steps (its latest complete step). A sharded (FSDP) step
            is merged tensor by tensor (``select`` defaults to its model; see ``_merge``). In gpukit's own step
            files ``select`` names a saved object (``"model"``), as in ``save(step, model=...)``.
        target: the file to write.
        strip_prefix: remove ``module.`` / ``_orig_mod.`` from every state dict inside.
        to_cpu: load everything onto the CPU (otherwise devices are kept where available).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: cast floating-point tensors.
        format: ``"torch"`` or ``"safetensors"`` (by default from ``target``'s extension).
        select: a dotted key path to convert only a part, e.g. ``"model"``.
        trust: allow full unpickling of ``source`` (only for files you trust).

    Returns:
        ``{"target", "format", "tensors", "size_bytes"}``.

    Raises:
        CheckpointError: ``source`` cannot be read or ``target`` cannot be written.
        ConfigurationError: an unknown dtype, format or ``select`` path.
    """
    src = Path(source)
    check_output(Path(target))
    if dtype is not None and dtype not in DTYPES:
        raise ConfigurationError(f"Unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if src.is_dir() and not os.path.lexists(src / MARKER_NAME):  # a CheckpointManager directory: its latest step
        latest = CheckpointManager(src).latest()
        if latest is None:
            raise CheckpointError(f"{src} is a directory without a complete gpukit checkpoint; give a checkpoint "
                                  "file, a step_NNNNNNNN directory or the directory holding them.")
        src = latest
    if src.is_dir() and is_sharded_checkpoint(src) and (not select or select.split(".")[0] in sharded_names(src, trust)):
        return merge_sharded(src, target, select=select, dtype=DTYPES[dtype] if dtype else None, format=format,
                             trust=trust)
    state: Any = load(src / SHARED_FILE if src.is_dir() else src, map_location="cpu" if to_cpu else "auto",
                      trust=trust)
    parts = select.split(".") if select else []
    if _is_manager_file(state):  # gpukit's own step files: select among the saved objects
        state = state["objects"]
        parts = parts[1:] if parts[:1] == ["objects"] and "objects" not in state else parts
    for part in parts:
        if not isinstance(state, dict) or part not in state:
            have = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
            if src.is_dir() and is_sharded_checkpoint(src):
                have += f"; sharded: {', '.join(sorted(sharded_names(src, trust)))}"
            raise ConfigurationError(f"--select {select!r}: no key {part!r} here; available: {have}.")
        state = state[part]
    if strip_prefix:
        state = _strip_all(state)
    if dtype is not None:
        wanted = DTYPES[dtype]
        state = _map_tensors(state, lambda t: t.to(wanted) if t.is_floating_point() else t)
    try:
        written = save(state, target, format=format, rank_zero_only=False)
    except ConfigurationError as exc:
        if not isinstance(state, dict) or "flat mapping" not in str(exc):
            raise
        raise ConfigurationError(
            f"{exc} To export one part, select it (gpukit ckpt convert --select KEY); keys here: "
            f"{', '.join(map(str, state))}."
        ) from None
    count = sum(1 for _, v in _walk(state) if isinstance(v, torch.Tensor)) if not isinstance(
        state, torch.Tensor) else 1
    return {"target": str(written), "format": format_for_save(written, format),
            "tensors": count, "size_bytes": written.stat().st_size}
