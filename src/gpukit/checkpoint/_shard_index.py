"""DCP's shard index (``.metadata``) read without running code, checked before it is used.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with plain ``pickle``: a planted file runs its ``__reduce__``. Here it is read through a
restricted unpickler that admits only what DCP metadata is made of (measured with pickletools
on real FSDP checkpoints: the dataclasses of ``torch.distributed.checkpoint.metadata``,
``filesystem._StorageInfo``, ``torch.Size``, torch dtypes, layouts via
``torch.serialization._get_layout``, and a path for the checkpoint id), refusing any other
global with an :class:`~gpukit.errors.UnsafeCheckpointError` naming the file. Nothing it
admits can run code: each is a data class, an enum or a lookup.

The result is then checked: types, shapes within their tensors, shard files that are regular
files inside the step directory with every byte range inside them, and tensors that claim no
more bytes than the shards hold (so a merge never allocates what a hostile index claims).

:class:`SafeReader` gives DCP's load path this index, and :class:`SafeLoadPlanner` reads the
non-tensor entries of the shards (optimizer hyperparameters) with ``weights_only=True``
where DCP's default planner uses full unpickling.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from gpukit.checkpoint._untrusted import is_plain_name, read_bytes, regular_file_size
from gpukit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["INDEX_FILE", "read_shard_index", "SafeReader", "SafeLoadPlanner", "MAX_INDEX_BYTES"]

INDEX_FILE = ".metadata"
#: a shard index lists every chunk of every tensor: tens of MB for very large jobs
MAX_INDEX_BYTES = 1 * 2**30
_MAX_ENTRIES = 10_000_000
#: a real chunk costs far more in the pickle (its offsets and sizes, its shard location)
_MIN_BYTES_PER_CHUNK = 16
_MAX_CHUNKS_PER_TENSOR = 1 << 16
_MAX_NUMEL = 1 << 48

_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
_ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n) for n in _METADATA_CLASSES
       if hasattr(dcp_md, n)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # the checkpoint id is informational: a pure path never touches the file system
    ("pathlib", "PosixPath"): PurePosixPath, ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath, ("pathlib", "PureWindowsPath"): PureWindowsPath,
    ("collections", "OrderedDict"): dict,
    **{("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
}
# Pickle's BUILD may set attributes on an admitted class itself; these are checked after loading.
_MUTABLE = [obj for obj in _ALLOWED.values() if hasattr(obj, "__dict__") and not isinstance(obj, torch.dtype)]


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None


def _unsafe(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"Refused to read the shard index {path}: it pickles {what}, which DCP metadata never holds, and "
        "unpickling it could run code. Nothing was executed. If you trust the file's source, pass "
        "trust=True (CLI: --trust)."
    )


def _put_back(before: list[dict[str, Any]]) -> list[Any]:
    """Undo attributes a pickle's BUILD set on admitted classes; returns the classes it touched."""
    changed = []
    for obj, saved in zip(_MUTABLE, before):
        current = dict(vars(obj))
        if current == saved:
            continue
        changed.append(obj)
        for key in set(current) - set(saved):
            delattr(obj, key)
        for key, value in saved.items():
            if current.get(key) is not value:
                setattr(obj, key, value)
    return changed


def _unpickle(path: Path, data: bytes) -> Any:
    before = [dict(vars(obj)) for obj in _MUTABLE]
    try:
        result = _Unpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise _unsafe(path, exc.name) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, OverflowError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"The shard index {path} is damaged: {type(exc).__name__}: {str(exc)[:200]}. "
                              "Use an older checkpoint or copy the step directory again.") from None
    finally:
        changed = _put_back(before)
    if changed:
        raise _unsafe(path, f"new attributes for {', '.join(getattr(o, '__name__', '?') for o in changed)}")
    return result


def _size(value: Any, ndim: int | None = None) -> bool:
    return (isinstance(value, torch.Size) and all(v >= 0 for v in value)
            and (ndim is None or len(value) == ndim))


def _check(metadata: Any, directory: Path, path: Path, index_bytes: int) -> None:
    """Types, bounds and shard files of an unpickled index; CheckpointError on the first fault.

    Work is bounded by the index's size: a pickle can name one object a million times in a few
    bytes each, so an index may list at most one chunk or shard location per
    :data:`_MIN_BYTES_PER_CHUNK` of its bytes (a real chunk takes far more), at most
    :data:`_MAX_CHUNKS_PER_TENSOR` chunks per tensor, and a tensor's chunks must hold each of its
    elements exactly once (so a chunk listed twice is refused).
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"The shard index {path} is damaged: {why}. Use an older checkpoint.")

    if not isinstance(metadata, dcp_md.Metadata):
        raise bad(f"it holds a {type(metadata).__name__}, not DCP metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("its tensor list or its storage map is not a mapping")
    most = min(_MAX_ENTRIES, max(64, index_bytes // _MIN_BYTES_PER_CHUNK))
    if len(entries) > most or len(storage) > most:
        raise bad(f"it lists {max(len(entries), len(storage)):,} entries in {index_bytes:,} bytes, more than "
                  "such an index can hold")
    claimed_bytes = chunk_count = 0
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise bad(f"a key is a {type(key).__name__}")
        if isinstance(entry, dcp_md.BytesStorageMetadata):
            continue
        if not isinstance(entry, dcp_md.TensorStorageMetadata) or not isinstance(
                entry.properties, dcp_md.TensorProperties) or not isinstance(entry.properties.dtype, torch.dtype):
            raise bad(f"{key!r} is neither a tensor nor bytes entry")
        if not _size(entry.size) or not isinstance(entry.chunks, list):
            raise bad(f"{key!r} has no valid size or chunk list")
        numel = math.prod(int(d) for d in entry.size)  # Python ints: torch.Size.numel() wraps around
        if numel > _MAX_NUMEL:
            raise bad(f"{key!r} has shape {list(entry.size)}: {numel:,} elements, more than any tensor can hold")
        chunk_count += len(entry.chunks)
        if len(entry.chunks) > _MAX_CHUNKS_PER_TENSOR or chunk_count > most:
            raise bad(f"{key!r} is split into {len(entry.chunks):,} chunks ({chunk_count:,} so far), more than "
                      "such an index can hold")
        covered = 0
        for chunk in entry.chunks:
            if not (isinstance(chunk, dcp_md.ChunkStorageMetadata) and _size(chunk.offsets, len(entry.size))
                    and _size(chunk.sizes, len(entry.size))
                    and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, entry.size))):
                raise bad(f"a chunk of {key!r} lies outside its tensor of shape {list(entry.size)}")
            covered += math.prod(int(d) for d in chunk.sizes)
        if covered != numel:
            raise bad(f"the chunks of {key!r} hold {covered:,} elements, but its shape {list(entry.size)} has "
                      f"{numel:,} (chunks missing or listed twice)")
        claimed_bytes += numel * entry.properties.dtype.itemsize
    shard_bytes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(info, dcp_fs._StorageInfo):
            raise bad("its storage map holds something else than shard locations")
        name = info.relative_path
        if not is_plain_name(name):
            raise bad(f"a shard is named {str(name)[:80]!r}: shards are files in the step directory itself")
        if name not in shard_bytes:
            _inside(directory, name, bad)
            shard_bytes[name] = regular_file_size(directory / name, "shard file")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
                and 0 <= info.length and info.offset + info.length <= shard_bytes[name]):
            raise bad(f"{index.fqn!r} lies at bytes {info.offset}+{info.length} of {name}, which has "
                      f"{shard_bytes[name]:,} bytes")
    if claimed_bytes > sum(shard_bytes.values()):
        raise bad(f"its tensors claim {claimed_bytes:,} bytes but the shard files hold {sum(shard_bytes.values()):,}")


def _inside(directory: Path, name: str, bad: Any) -> None:
    """A shard that is a symlink must stay inside the step directory."""
    shard = directory / name
    if os.path.islink(shard):
        target = os.path.realpath(shard)
        if os.path.dirname(target) != os.path.realpath(directory):
            raise bad(f"the shard {name} is a symlink to {target[:200]}, outside the step directory")


def read_shard_index(directory: Path, trust: bool = False) -> Any:
    """DCP's metadata of the sharded step ``directory``, read without running code and checked.

    Args:
        directory: a step directory holding ``.metadata`` and ``*.distcp`` shards.
        trust: unpickle with plain ``pickle`` as DCP does (only for files you trust).

    Raises:
        UnsafeCheckpointError: the index pickles anything but DCP metadata (and ``trust`` is False).
        CheckpointError: the index or a shard it names is missing, special, oversized or damaged.
    """
    directory = Path(directory)
    path = directory / INDEX_FILE
    data = read_bytes(path, MAX_INDEX_BYTES, "shard index")
    if trust:
        try:
            metadata = pickle.loads(data)  # noqa: S301 - the caller trusts this file
        except Exception as exc:
            raise CheckpointError(f"The shard index {path} is damaged: {type(exc).__name__}: {exc}.") from None
    else:
        metadata = _unpickle(path, data)
    _check(metadata, directory, path, len(data))
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with its index read by :func:`read_shard_index` (once, then reused)."""

    def __init__(self, directory: Path, metadata: Any = None, trust: bool = False) -> None:
        super().__init__(str(directory))
        self._directory = Path(directory)
        self._trust = trust
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # per-rank indexes: gpukit never writes them
            raise CheckpointError(f"{self._directory} asks for a per-rank shard index, which gpukit does not read.")
        if self._metadata is None:
            self._metadata = read_shard_index(self._directory, self._trust)
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor shard entries with ``weights_only=True``."""

    def __init__(self, directory: Path, trust: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._directory = directory
        self._trust = trust

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._trust:
            return super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(
                f"Refused the entry {fqn!r} of the shards in {self._directory}: it needs full unpickling, which "
                f"could run code ({str(exc).splitlines()[0][:160]}). Nothing was executed. If you trust the "
                "files' source, pass trust=True (CLI: --trust)."
            ) from None
        except Exception as exc:
            raise CheckpointError(f"The entry {fqn!r} of the shards in {self._directory} is damaged: "
                                  f"{type(exc).__name__}: {str(exc)[:160]}.") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
        return None

