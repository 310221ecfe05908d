"""A model's tensors in checkpoint files, found by name and read one at a time into place.

``open_tensor_files(path)`` takes what people hold:

- a safetensors file, or a folder of them (Hugging Face's ``model.safetensors.index.json`` says which
  shard holds which tensor; without it every ``*.safetensors`` in the folder is read);
- a torch file (zip format), or a folder of them with ``pytorch_model.bin.index.json``;
- a gpukit sharded step directory (DCP: ``.metadata`` and ``*.distcp``), the model's part of it.

Nothing is read but headers until a tensor is asked for; every header is checked first (sizes,
offsets inside the file, no code run: ``_formats.read_safetensors_header``, ``_lazy.open_lazy`` with
``weights_only``, ``_shard_index``). A tensor then goes from the file straight into the tensor given
(``preadv`` into CPU memory; through one CPU tensor for another device), so reading a model holds at
most one tensor in host memory beside the model's own. Safetensors and zip entries stay where they
are in their file (:meth:`TensorFiles.location`): offloaded weights are read from the original file,
never copied.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpukit.checkpoint._formats import (
    SAFETENSORS,
    SAFETENSORS_DTYPES,
    TORCH_ZIP,
    check_readable_file,
    read_safetensors_header,
    sniff_format,
)
from gpukit.checkpoint._lazy import LazyCheckpoint
from gpukit.checkpoint._untrusted import is_plain_name, read_json
from gpukit.errors import CheckpointError, StateDictMismatchError

__all__ = ["TensorFiles", "open_tensor_files", "safetensors_entries"]

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_MAX_FILES = 100_000
#: stored dtypes a model's floating tensor may be read from (a cast, no scales): anything else is quantised
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Entry:
    meta: torch.Tensor  # shape and dtype; for located formats its storage knows its file offset
    file: Path | None  # None: a DCP entry


class TensorFiles:
    """Tensors of one checkpoint by name (see the module docstring). Close it when done."""

    def __init__(self, source: Path, entries: dict[str, _Entry], files: dict[Path, LazyCheckpoint],
                 dcp: tuple[Path, Any, str] | None = None) -> None:
        self.source = source
        self._entries = entries
        self._files = files
        self._dcp = dcp
        self._maps: dict[Path, mmap.mmap] = {}

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for lazy in self._files.values():
            lazy.close()
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:  # tensors over it are still alive: it closes when they go
                pass
        self._maps.clear()

    def mapped(self, name: str) -> torch.Tensor | None:
        """``name`` as a tensor over a private memory map of its file: no copy, its pages read when
        first touched (and dropped again by :meth:`release`); ``None`` when it has no byte range of
        its own or its offset does not suit its dtype."""
        where = self.location(name)
        if where is None or where[1] % self._entries[name].meta.element_size():
            return None
        path, offset, nbytes = where
        meta = self._entries[name].meta
        if nbytes == 0:
            return torch.empty(meta.shape, dtype=meta.dtype)
        mapping = self._maps.get(path)
        if mapping is None:
            with open(path, "rb") as handle:  # checked a regular file of this size when opened
                mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[path] = mapping
        if offset + nbytes > len(mapping):
            raise CheckpointError(f"{path} is shorter than when it was opened (changed while in use?).")
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(meta.dtype).view(meta.shape)

    def release(self, name: str) -> None:
        """Drop ``name``'s pages from this process's memory (they are read from the file again if used)."""
        where = self.location(name)
        mapping = self._maps.get(where[0]) if where is not None else None
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        start = where[1] - where[1] % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, start, where[1] + where[2] - start)

    def meta_tree(self) -> OrderedDict[str, torch.Tensor]:
        """Every tensor as a meta tensor (shape, dtype), by its name in the checkpoint."""
        return OrderedDict((name, entry.meta) for name, entry in self._entries.items())

    @property
    def largest_file_bytes(self) -> int:
        return max((lazy.size_bytes for lazy in self._files.values()), default=0)

    def keys_for(self, model: torch.nn.Module) -> dict[int, str]:
        """id(tensor of ``model``) -> its key here, for every parameter and persistent buffer (wrapper
        prefixes handled as ``load_state_dict`` does; tied names share one key).

        Raises:
            StateDictMismatchError: shapes differ, or meta tensors of the model are not in the files.
        """
        from gpukit.checkpoint._prefixes import match_state_dict

        tree = self.meta_tree()
        by_object = {id(v): k for k, v in tree.items()}
        _, remapped, _ = match_state_dict(model, tree, strict=False)  # shapes checked: nothing read
        state = dict(model.state_dict(keep_vars=True))
        keys: dict[int, str] = {}
        for name, value in remapped.items():
            if name in state and id(value) in by_object:
                keys.setdefault(id(state[name]), by_object[id(value)])
        for name, tensor in state.items():
            key = keys.get(id(tensor))
            if key is not None and tensor.is_floating_point() and tree[key].dtype not in _FLOAT_DTYPES:
                raise CheckpointError(
                    f"{self.source}: {key!r} is stored as {tree[key].dtype} where {type(model).__name__} has "
                    f"{tensor.dtype} weights: a quantised checkpoint (casting it without its scales would give wrong "
                    f"outputs). Supported: weights stored as {', '.join(str(d) for d in _FLOAT_DTYPES)} (cast to "
                    "the planned dtype); float8/int8 weights with scales, bitsandbytes, GPTQ and AWQ are not. Load "
                    "it with its quantisation library, or save its weights dequantised (bf16 or fp32) first.")
        missing = sorted({n for n, t in state.items() if id(t) not in keys and t.is_meta})
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise StateDictMismatchError(f"The checkpoint {self.source} lacks {len(missing)} tensor(s) of "
                                         f"{type(model).__name__}: {shown}. Check that it is this model's checkpoint.")
        return keys

    def location(self, name: str) -> tuple[Path, int, int] | None:
        """``(file, offset, bytes)`` where ``name``'s data lies whole and contiguous; ``None`` when
        it does not (a DCP chunk, a view into a shared storage)."""
        entry = self._entries[name]
        offset = getattr(entry.meta.untyped_storage(), "_checkpoint_offset", None)
        whole = entry.meta.untyped_storage().nbytes() == entry.meta.numel() * entry.meta.element_size()
        if entry.file is None or not isinstance(offset, int) or not whole or not entry.meta.is_contiguous() \
                or entry.meta.storage_offset() != 0:
            return None
        return entry.file, offset, entry.meta.numel() * entry.meta.element_size()

    def read_bytes_into(self, name: str, target: memoryview) -> None:
        """Fill ``target`` (exactly the tensor's bytes) from the file; only for a :meth:`location`."""
        where = self.location(name)
        if where is None or where[2] != target.nbytes:
            raise CheckpointError(f"{self.source}: {name!r} cannot be read by byte range.")
        self._files[where[0]]._read_into(where[1], target)  # bounds-checked against the file

    def read_into(self, pairs: dict[str, torch.Tensor]) -> None:
        """Read each named tensor into the tensor given (same shape; a dtype cast where they differ).

        Raises:
            CheckpointError: a file is damaged, changed, or shorter than its header said.
        """
        dcp_keys: dict[str, torch.Tensor] = {}
        for name, dest in pairs.items():
            entry = self._entries[name]
            if entry.file is None:
                dcp_keys[name] = dest
                continue
            lazy = self._files[entry.file]
            with torch.no_grad():
                if not lazy._fill_one(entry.meta, dest):  # another dtype, or a view: through the CPU
                    dest.copy_(lazy.materialize(entry.meta))
                    lazy._storages.clear()
        if dcp_keys:
            self._read_dcp(dcp_keys)

    def _read_dcp(self, pairs: dict[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        from gpukit.checkpoint._shard_index import SafeReader

        directory, metadata, prefix = self._dcp  # type: ignore[misc]
        wanted = {f"{prefix}{k}": (v if v.device.type == "cpu" and v.dtype == self._entries[k].meta.dtype
                                   else torch.empty(v.shape, dtype=self._entries[k].meta.dtype))
                  for k, v in pairs.items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(wanted, storage_reader=SafeReader(directory, metadata), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - a shard that is not what its index says
            raise CheckpointError(f"Cannot read {', '.join(list(pairs)[:3])} from the shards of {directory}: "
                                  f"{type(exc).__name__}: {str(exc)[:300]}. Use an older checkpoint.") from None
        with torch.no_grad():
            for key, dest in pairs.items():
                got = wanted[f"{prefix}{key}"]
                if got is not dest:
                    dest.copy_(got)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for dim in reversed(shape):
        out.append(stride)
        stride *= max(dim, 1)
    return tuple(reversed(out))


def safetensors_entries(path: Path, size: int) -> OrderedDict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors whose storages record their offset in the file
    (as ``torch.load`` with ``map_location="meta"`` records a zip entry's): read by ``LazyCheckpoint``."""
    header = read_safetensors_header(path, size)  # refuses absurd sizes and offsets before anything is read
    with open(path, "rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]][0])
        begin, end = entry["data_offsets"]
        storage = torch.UntypedStorage(end - begin, device="meta")
        storage._checkpoint_offset = data_start + begin  # type: ignore[attr-defined] # what torch.load records
        shape = tuple(entry["shape"])
        out[key] = torch.empty(0, dtype=dtype, device="meta").set_(storage, 0, shape, _contiguous_stride(shape))
    return out


def _open_file(path: Path, trust: bool) -> tuple[LazyCheckpoint, dict[str, torch.Tensor]]:
    size = check_readable_file(path)
    if sniff_format(path, size) == SAFETENSORS:
        tree = safetensors_entries(path, size)
        return LazyCheckpoint(path, size, tree), tree
    from gpukit.checkpoint._read import load_lazy

    lazy = load_lazy(path, trust=trust)
    tree = lazy.tree
    if isinstance(tree, dict) and isinstance(tree.get("state_dict"), dict):
        tree = tree["state_dict"]  # a Lightning-style file
    if not isinstance(tree, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()):
        lazy.close()
        raise CheckpointError(f"{path} holds no state dict of tensors by name (a whole training state?): give the "
                              "model's weights file, or convert it with gpukit ckpt convert.")
    if sniff_format(path, size) != TORCH_ZIP:  # read whole by the ordinary reader: CPU tensors, no offsets
        tree = {k: v for k, v in tree.items()}
    return lazy, tree


def _folder_files(folder: Path) -> list[Path]:
    for index_name in _INDEXES:
        index = folder / index_name
        if index.exists():
            weight_map = read_json(index, "checkpoint index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map of tensor names to shard files.")
            names = sorted(set(weight_map.values()), key=str)
            bad = [n for n in names if not is_plain_name(n)]
            if bad:
                raise CheckpointError(f"{index} names the shard {str(bad[0])[:80]!r}: shards are files in its own folder.")
            return [folder / n for n in names]
    found = sorted(folder.glob("*.safetensors")) or sorted([*folder.glob("*.bin"), *folder.glob("*.pt")])
    if not found:
        raise CheckpointError(f"{folder} holds no checkpoint gpukit reads: no safetensors or torch files, no "
                              f"{' or '.join(_INDEXES)}, no sharded (DCP) .metadata.")
    return found


def open_tensor_files(path: str | os.PathLike[str], *, select: str | None = None, trust: bool = False) -> TensorFiles:
    """Open a checkpoint's tensors by name (see the module docstring); nothing but headers is read.

    Args:
        path: a file, a folder of shards, or a sharded (DCP) step directory.
        select: in a DCP step directory, the object to read (default: the only model in it).
        trust: allow full unpickling of torch files and the DCP index (files you trust only).

    Raises:
        CheckpointError, UnsafeCheckpointError: what cannot be read, or would run code.
        ConfigurationError: a DCP directory holding several models and no ``select``.
    """
    source = Path(path)
    if source.is_dir() and os.path.lexists(source / ".metadata"):
        from gpukit.checkpoint._sharded_objects import chosen_object
        from gpukit.checkpoint._sharded import read_metadata

        metadata = read_metadata(source, trust)
        name, chosen = chosen_object(metadata, select, source)
        entries = {k: _Entry(torch.empty(tuple(v.size), dtype=v.properties.dtype, device="meta"), None)
                   for k, v in chosen.items()}
        return TensorFiles(source, entries, {}, (source, metadata, f"{name}."))
    files = _folder_files(source) if source.is_dir() else [source]
    if len(files) > _MAX_FILES:
        raise CheckpointError(f"{source} lists {len(files):,} shard files, more than {_MAX_FILES:,}.")
    opened: dict[Path, LazyCheckpoint] = {}
    entries: dict[str, _Entry] = {}
    try:
        for file in files:
            lazy, tree = _open_file(file, trust)
            opened[file] = lazy
            for key, meta in tree.items():
                if key in entries:
                    raise CheckpointError(f"{source}: the tensor {key!r} is in two shards ({entries[key].file} and "
                                          f"{file}); which one is meant cannot be told.")
                entries[key] = _Entry(meta, file)
    except BaseException:
        for lazy in opened.values():
            lazy.close()
        raise
    return TensorFiles(source, entries, opened)
