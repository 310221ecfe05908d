"""Describe a sharded step directory, and merge its shards into one file with bounded host memory.

Merging reads DCP's index (``.metadata``: every tensor's shape, dtype and where its slices
lie), writes the safetensors header first, then loads tensors in small groups (at most
``budget_bytes`` at a time, or one tensor when it is larger) through
``torch.distributed.checkpoint.FileSystemReader`` -- which reads only the byte ranges of the
requested slices -- and appends each group's bytes. Host memory therefore stays at about one
group, never the whole model (let alone twice). A torch-format target is written by
``torch.save`` and holds the selected object once.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from gpukit.checkpoint._atomic import atomic_write
from gpukit.checkpoint._formats import SAFETENSORS_DTYPES, format_for_save, safetensors_metadata
from gpukit.checkpoint._io import save
from gpukit.checkpoint._sharded_objects import chosen_object as _chosen
from gpukit.checkpoint._sharded_objects import is_optimizer as _is_optimizer
from gpukit.checkpoint._sharded_objects import tensor_entries as _tensors
from gpukit.checkpoint._sharded import METADATA_FILE, read_metadata
from gpukit.checkpoint._untrusted import check_output
from gpukit.errors import CheckpointError

__all__ = ["describe_sharded", "merge_sharded", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 256 * 2**20
_SAFETENSORS_CODES = {getattr(torch, name): code for code, (name, _) in SAFETENSORS_DTYPES.items() if hasattr(torch, name)}


def describe_sharded(step_dir: Path, world_size: int, trust: bool = False) -> dict[str, Any]:
    """What a sharded step directory holds: shard files, world size, per-object tensors and bytes."""
    metadata = read_metadata(step_dir, trust)
    shard_files = sorted(p for p in Path(step_dir).glob("*.distcp"))
    keys = list(metadata.state_dict_metadata)
    objects: dict[str, dict[str, Any]] = {}
    for key, meta in _tensors(metadata).items():
        name = key.split(".", 1)[0]
        entry = objects.setdefault(name, {"kind": "optimizer" if _is_optimizer(keys, name) else "model",
                                          "tensors": 0, "numel": 0, "bytes": 0, "dtypes": {}})
        numel = int(torch.Size(meta.size).numel())
        dtype = str(meta.properties.dtype).replace("torch.", "")
        entry["tensors"] += 1
        entry["numel"] += numel
        entry["bytes"] += numel * meta.properties.dtype.itemsize
        entry["dtypes"][dtype] = entry["dtypes"].get(dtype, 0) + 1
    return {"format": "torch.distributed.checkpoint", "world_size": world_size,
            "shard_files": len(shard_files), "shard_bytes": sum(p.stat().st_size for p in shard_files),
            "index_file": METADATA_FILE, "objects": objects}


def _groups(chosen: dict[str, Any], budget_bytes: int) -> Iterator[list[str]]:
    group: list[str] = []
    size = 0
    for key, meta in chosen.items():
        nbytes = int(torch.Size(meta.size).numel()) * meta.properties.dtype.itemsize
        if group and size + nbytes > budget_bytes:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    if group:
        yield group


def _load(source: Path, metadata: Any, prefix: str, chosen: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from gpukit.checkpoint._shard_index import SafeReader

    wanted = {f"{prefix}{k}": torch.empty(chosen[k].size, dtype=chosen[k].properties.dtype) for k in keys}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, storage_reader=SafeReader(source, metadata), no_dist=True)
    except CheckpointError:
        raise
    except (dcp.CheckpointException, Exception) as exc:  # a shard that is not what its index says
        from gpukit.checkpoint._sharded import _failures

        shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        raise CheckpointError(f"Cannot read the tensors {shown} from the shards of {source}: "
                              f"{_failures(exc).split('. ')[0][:300]}. A shard file is damaged or is not a shard; "
                              "use an older "
                              "checkpoint.") from None
    return {k: wanted[f"{prefix}{k}"] for k in keys}


def merge_sharded(
    source: Path, target: str | os.PathLike[str], *, select: str | None = None, dtype: torch.dtype | None = None,
    format: str | None = None, budget_bytes: int = DEFAULT_BUDGET_BYTES, trust: bool = False,
) -> dict[str, Any]:
    """Merge one sharded object of the step directory ``source`` into the file ``target``.

    Args:
        source: a sharded step directory (holding ``.metadata`` and ``*.distcp`` shards).
        target: the file to write (atomically).
        select: the object to merge (default: the only model in the checkpoint).
        dtype: cast floating-point tensors to it.
        format: "safetensors" (streamed tensor by tensor) or "torch"; default from the suffix.
        budget_bytes: host memory for tensors loaded at once (a larger tensor is loaded alone).
        trust: unpickle the shard index freely (by default it is read without running code).

    Returns:
        ``{"target", "format", "tensors", "size_bytes"}``.

    Raises:
        ConfigurationError: ``select`` names nothing sharded, or several objects and none chosen.
        CheckpointError: a shard or the index cannot be read, or ``target`` cannot be written.
    """
    out = Path(target)
    check_output(out)
    metadata = read_metadata(source, trust)
    name, chosen = _chosen(metadata, select, source)
    prefix = f"{name}."
    fmt = format_for_save(out, format)
    cast = (lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t)
    if fmt == "torch":
        state = {k: cast(v) for k, v in _load(source, metadata, prefix, chosen, list(chosen)).items()}
        written = save(state, out, format="torch", rank_zero_only=False)
        return {"target": str(written), "format": fmt, "tensors": len(state), "size_bytes": written.stat().st_size}
    header: dict[str, Any] = {"__metadata__": safetensors_metadata(gpukit_merged_from=str(source))}
    offset = 0
    for key, meta in chosen.items():
        out_dtype = dtype if dtype is not None and meta.properties.dtype.is_floating_point else meta.properties.dtype
        nbytes = int(torch.Size(meta.size).numel()) * out_dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_CODES[out_dtype], "shape": list(meta.size),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for keys in _groups(chosen, budget_bytes):
            for key, tensor in _load(source, metadata, prefix, chosen, keys).items():
                flat = cast(tensor).contiguous().reshape(-1)
                f.write(memoryview(flat.view(torch.uint8).numpy()))

    size = atomic_write(out, write)
    return {"target": str(out), "format": fmt, "tensors": len(chosen), "size_bytes": size}
