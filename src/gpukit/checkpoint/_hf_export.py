"""Export weights as a folder that Hugging Face ``from_pretrained`` loads.

The folder is what ``save_pretrained`` writes: ``model.safetensors`` -- or, above
``max_shard_bytes``, ``model-00001-of-0000N.safetensors`` shards listed in
``model.safetensors.index.json`` -- every file with the ``{"format": "pt"}`` metadata
transformers 4.x requires, plus ``config.json`` when a config is given or the model has one.

The weights are first written as one safetensors file next to the folder's files (through
the same code as ``gpukit ckpt convert``: prefixes stripped, sharded FSDP checkpoints merged
with bounded memory), then split by copying byte ranges, so memory stays bounded by the
conversion, not the shard count.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from gpukit.checkpoint._atomic import atomic_write, clean_temp_files, fsync_directory, temp_path_for
from gpukit.checkpoint._dist import current_dist
from gpukit.checkpoint._formats import read_safetensors_header, safetensors_metadata
from gpukit.checkpoint._gather import gather_sharded
from gpukit.errors import CheckpointError, ConfigurationError

__all__ = ["export_pretrained", "DEFAULT_MAX_SHARD_BYTES", "WEIGHTS_NAME", "INDEX_NAME", "CONFIG_NAME"]

#: transformers' ``save_pretrained(max_shard_size="5GB")`` default (decimal gigabytes)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_MAX_CONFIG_BYTES = 16 * 2**20
_COPY_CHUNK_BYTES = 64 * 2**20
_MERGED_NAME = "gpukit-export.safetensors"  # only ever present as a hidden temporary file


def _config_from_path(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {CONFIG_NAME}" if path.is_dir() else f"{path} does not exist or is not a file"
        raise ConfigurationError(f"config {str(path)!r}: {where}. Give a config.json file or the folder of a "
                                 "Hugging Face model that holds one.")
    if file.stat().st_size > _MAX_CONFIG_BYTES:
        raise ConfigurationError(f"config {str(file)!r} is {file.stat().st_size:,} bytes; a model config is a "
                                 f"small JSON file (at most {_MAX_CONFIG_BYTES:,} bytes here).")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"config {str(file)!r} is not valid JSON ({exc}).") from None
    except RecursionError:
        raise ConfigurationError(f"config {str(file)!r} nests JSON too deeply to be a model config.") from None
    if not isinstance(config, dict):
        raise ConfigurationError(f"config {str(file)!r} holds a JSON {type(config).__name__}; a model config "
                                 "is a JSON object such as {\"model_type\": \"llama\", ...}.")
    return config


def _config_json(config: Any, source: Any) -> dict[str, Any] | None:
    """The config to write as a dict: given, or the model's own (``model.config``), or None."""
    if config is None and isinstance(source, nn.Module):
        from gpukit.placement import unwrap_model

        config = getattr(unwrap_model(source), "config", None)
        if config is None:
            return None
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        return _config_from_path(Path(config))
    if isinstance(config, Mapping):
        return json.loads(json.dumps(dict(config)))  # must be JSON; a copy we may change
    if callable(getattr(config, "to_json_string", None)):  # a transformers PretrainedConfig
        return dict(json.loads(config.to_json_string()))
    raise ConfigurationError(f"config: got a {type(config).__name__}; give a path to config.json, a dict, or a "
                             "transformers config object (model.config).")


def _model_class_name(model: nn.Module) -> str:
    """The user's model class, under the classes FSDP2 (``FSDPLlamaForCausalLM``) or gpukit put on top."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith(("torch.distributed", "gpukit.")):
            return cls.__name__
    return type(model).__name__


def _write_merged(source: Any, merged: Path, *, select: str | None, dtype: str | None, trust: bool) -> None:
    """All weights of ``source`` as one safetensors file ``merged`` (on rank 0 under torch.distributed)."""
    from gpukit.checkpoint._inspect import DTYPES, convert_checkpoint
    from gpukit.checkpoint._io import save, to_saveable

    if isinstance(source, (str, os.PathLike)):
        convert_checkpoint(source, merged, strip_prefix=True, to_cpu=True, dtype=dtype, format="safetensors",
                           select=select, trust=trust)
        return
    if dtype is not None and dtype not in DTYPES:
        raise ConfigurationError(f"Unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if not isinstance(source, (nn.Module, Mapping)):
        raise ConfigurationError(f"export_pretrained: got a {type(source).__name__} to export; give a model, a "
                                 "state dict, or the path of a checkpoint.")
    state = gather_sharded(source, everywhere=False)  # collective: an FSDP model's full tensors, on rank 0
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for k, v in to_saveable(state).items()}
    save(state, merged, format="safetensors")  # collective: rank 0 writes


def _plan_shards(header: dict[str, Any], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard in file order; a new shard starts where one would exceed the limit."""
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    shards: list[list[str]] = [[]]
    size = 0
    for key in keys:
        begin, end = header[key]["data_offsets"]
        if shards[-1] and size + (end - begin) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += end - begin
    return shards


def _copy_shard(merged: Path, data_start: int, header: dict[str, Any], keys: list[str]) -> Any:
    """A writer for one shard file holding ``keys``, copied byte for byte out of ``merged``."""
    shard_header: dict[str, Any] = {"__metadata__": safetensors_metadata()}
    offset = 0
    for key in keys:
        begin, end = header[key]["data_offsets"]
        shard_header[key] = {"dtype": header[key]["dtype"], "shape": header[key]["shape"],
                             "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    encoded = json.dumps(shard_header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned

    def write(out: BinaryIO) -> None:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        with open(merged, "rb") as src:
            for key in keys:
                begin, end = header[key]["data_offsets"]
                src.seek(data_start + begin)
                remaining = end - begin
                while remaining:
                    chunk = src.read(min(remaining, _COPY_CHUNK_BYTES))
                    if not chunk:
                        raise CheckpointError(f"{merged} ended early while exporting {key!r}.")
                    out.write(chunk)
                    remaining -= len(chunk)

    return write


def _remove_stale(directory: Path, keep: set[str]) -> list[str]:
    """Weight files of an earlier export that this one does not rewrite (from_pretrained would mix them in)."""
    removed = []
    for path in directory.iterdir():
        name = path.name
        if name in keep or not (name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(name)):
            continue
        path.unlink()
        removed.append(name)
    return sorted(removed)


def _split(merged: Path, directory: Path, max_shard_bytes: int) -> dict[str, Any]:
    header = read_safetensors_header(merged, merged.stat().st_size)
    with open(merged, "rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
    shards = _plan_shards(header, max_shard_bytes)
    total_bytes = sum(e - b for k, (b, e) in ((k, header[k]["data_offsets"]) for k in header if k != "__metadata__"))
    if len(shards) == 1:
        removed = _remove_stale(directory, {WEIGHTS_NAME})
        os.replace(merged, directory / WEIGHTS_NAME)  # already a complete file with the right metadata
        fsync_directory(directory)
        return {"files": [WEIGHTS_NAME], "index": None, "removed": removed, "total_bytes": total_bytes}
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        atomic_write(directory / name, _copy_shard(merged, data_start, header, keys))
    removed = _remove_stale(directory, {*names, INDEX_NAME})
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {key: name for name, keys in zip(names, shards) for key in sorted(keys)}}
    atomic_write(directory / INDEX_NAME, lambda f: f.write(json.dumps(index, indent=2, sort_keys=True).encode()))
    merged.unlink()
    return {"files": names, "index": INDEX_NAME, "removed": removed, "total_bytes": total_bytes}


def export_pretrained(
    source: Any,
    directory: str | os.PathLike[str],
    *,
    config: Any = None,
    select: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    trust: bool = False,
) -> dict[str, Any]:
    """Write ``source``'s weights (and config) as a folder ``from_pretrained`` loads.

    Under torch.distributed every rank calls it (an FSDP-sharded model is gathered); rank 0
    writes, and every rank returns once the folder is complete.

    Args:
        source: a model (wrapped or not, FSDP-sharded too), a state dict, or a checkpoint
            path (a file, a gpukit step directory or checkpoint directory, sharded or not).
        directory: the folder to write; created if missing. Weight files of an earlier export
            there (``model*.safetensors``, the index) are replaced, never mixed in.
        config: a ``config.json`` path, a folder holding one, a dict, or a transformers
            config; by default ``source.config`` when ``source`` is a model that has one.
        select: in a checkpoint, the object holding the weights (e.g. ``"model"``).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: cast floating-point weights.
        max_shard_bytes: larger weights are split into shards of at most this size (a
            single larger tensor gets a shard of its own), listed in ``model.safetensors.index.json``.
        trust: allow full unpickling of a checkpoint ``source`` (trusted files only).

    Returns:
        ``{"directory", "files", "index", "config", "tensors", "size_bytes", "removed"}``.

    Raises:
        ConfigurationError: a bad ``config``, ``select``, ``dtype`` or ``max_shard_bytes``.
        CheckpointError: ``source`` cannot be read, or ``directory`` cannot be written.
    """
    out = Path(directory)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ConfigurationError(f"max_shard_bytes={max_shard_bytes!r}: give a positive number of bytes "
                                 "(transformers' default is 5GB = 5_000_000_000).")
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"Cannot export to {out}: it is a file. from_pretrained loads a folder; give a "
                                 "folder path (it is created if missing).")
    config_dict = _config_json(config, source)
    if config_dict is not None and isinstance(source, nn.Module) and not config_dict.get("architectures"):
        from gpukit.placement import unwrap_model

        config_dict["architectures"] = [_model_class_name(unwrap_model(source))]  # as save_pretrained sets it
    merged = temp_path_for(out / _MERGED_NAME)
    dist = current_dist()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"Cannot create the export folder {out}: {exc.strerror or exc}.") from None
    if dist.is_main:
        clean_temp_files(out, for_name=_MERGED_NAME)  # left by a killed export
    try:
        _write_merged(source, merged, select=select, dtype=dtype, trust=trust)
        result: dict[str, Any] = {}
        failure: str | None = None
        if dist.is_main:
            try:
                result = _split(merged, out, max_shard_bytes)
                if config_dict is not None:
                    text = json.dumps(config_dict, indent=2, sort_keys=True) + "\n"
                    atomic_write(out / CONFIG_NAME, lambda f: f.write(text.encode()))
            except Exception as exc:  # every rank must hear of it
                failure = f"{type(exc).__name__}: {exc}"
                if dist.world_size == 1:
                    raise
        if dist.world_size > 1:
            failure = dist.broadcast_from_main(failure)
            if failure is not None:
                raise CheckpointError(f"Rank 0 failed to export to {out}: {failure}")
    finally:
        if dist.is_main and merged.exists():
            merged.unlink()
    files = [out / name for name in result.get("files", [])]
    return {"directory": str(out), "files": [str(f) for f in files], "index": result.get("index"),
            "config": str(out / CONFIG_NAME) if (out / CONFIG_NAME).exists() else None,
            "tensors": None if not files else sum(len(read_safetensors_header(f, f.stat().st_size)) - 1
                                                    for f in files),
            "size_bytes": sum(f.stat().st_size for f in files), "removed": result.get("removed", [])}
