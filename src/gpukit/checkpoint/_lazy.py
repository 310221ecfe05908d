"""Restore without a second copy: a torch zip checkpoint whose tensors are read straight into place.

``torch.load`` reads every tensor into new memory, and ``model.load_state_dict`` then copies
the weights a second time, so a restore briefly holds the weights twice. Here the file is
first unpickled with ``map_location="meta"`` (``weights_only``, so nothing can run code; no
tensor data is read), which gives every tensor's shape, dtype and the byte offset of its data
in the file. Then:

- a model's tensors are read from the file straight into the model's own parameters and
  buffers when shape and dtype match and they live in CPU memory (one ``preadv`` each, no
  intermediate tensor); on another device each tensor goes through one CPU tensor at a time;
- everything else (optimizer state, schedulers, ...) is read once into new CPU tensors,
  as ``torch.load`` would; tensors that shared storage when saved share it again.

Files it cannot open this way (legacy pickles, older torch without storage offsets) are
loaded with the ordinary reader, so callers never need to care which path was taken.
"""

from __future__ import annotations

import os
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.checkpoint._formats import TORCH_ZIP, sniff_format
from gpukit.errors import CheckpointError

__all__ = ["LazyCheckpoint", "open_lazy"]


def _is_lazy(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _offset(tensor: torch.Tensor) -> int | None:
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    return offset if isinstance(offset, int) else None


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, bfloat16 included)."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(bytearray())


class LazyCheckpoint:
    """An opened torch zip checkpoint: ``tree`` is its content with tensors still on disk.

    Use :meth:`materialize` for a part that should become ordinary CPU tensors, and
    :meth:`fill_state_dict` to read a model's part straight into the model's tensors. Close
    it (or use it as a context manager) when done.
    """

    def __init__(self, path: Path, size_bytes: int, tree: Any) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.tree = tree
        self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._storages: dict[int, torch.UntypedStorage] = {}  # file offset -> storage read

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (tensors already read stay valid: they are ordinary memory)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._storages.clear()

    def _check_extent(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size_bytes:
            raise CheckpointError(
                f"{self.path} is truncated or corrupted: a tensor's data ({nbytes:,} bytes at "
                f"offset {offset:,}) lies outside the {self.size_bytes:,}-byte file. Use an older checkpoint."
            )

    def _read_into(self, offset: int, target: memoryview) -> None:
        """Fill ``target`` from the file at ``offset``; a short file is a CheckpointError."""
        if self._fd is None:
            raise CheckpointError(f"{self.path} was closed before all of its tensors were read.")
        self._check_extent(offset, target.nbytes)
        done = 0
        while done < target.nbytes:
            got = os.preadv(self._fd, [target[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path} ended while reading a tensor (changed while being read?).")
            done += got

    def _storage_for(self, meta: torch.Tensor) -> torch.UntypedStorage:
        offset = _offset(meta)
        if offset is None:  # cannot happen for files opened by open_lazy; refuse rather than guess
            raise CheckpointError(f"{self.path}: a tensor has no recorded position in the file.")
        storage = self._storages.get(offset)
        if storage is None:
            nbytes = meta.untyped_storage().nbytes()
            self._check_extent(offset, nbytes)  # before allocating what the file claims
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._read_into(offset, _byte_view(buffer))
            storage = buffer.untyped_storage()
            self._storages[offset] = storage
        return storage

    def _tensor(self, meta: torch.Tensor) -> torch.Tensor:
        out = torch.empty(0, dtype=meta.dtype)
        out.set_(self._storage_for(meta), meta.storage_offset(), meta.size(), meta.stride())
        if isinstance(meta, nn.Parameter):
            return nn.Parameter(out, requires_grad=meta.requires_grad)
        return out

    def materialize(self, tree: Any) -> Any:
        """``tree`` with every on-disk tensor read into CPU memory (containers rebuilt, rest kept)."""
        if _is_lazy(tree):
            return self._tensor(tree)
        if isinstance(tree, Mapping):
            items = ((k, self.materialize(v)) for k, v in tree.items())
            out: dict[Any, Any] = OrderedDict(items) if isinstance(tree, OrderedDict) else dict(items)
            if hasattr(tree, "_metadata"):
                out._metadata = tree._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(tree, list):
            return [self.materialize(v) for v in tree]
        if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
            return tuple(self.materialize(v) for v in tree)
        return tree

    def _fill_one(self, meta: torch.Tensor, dest: torch.Tensor) -> bool:
        """Read ``meta``'s data straight into ``dest``; False when it cannot go there directly."""
        if type(dest) not in (torch.Tensor, nn.Parameter) or dest.dtype != meta.dtype or dest.shape != meta.shape:
            return False
        offset = _offset(meta)
        whole = meta.is_contiguous() and meta.untyped_storage().nbytes() == meta.numel() * meta.element_size()
        if offset is None or not whole or meta.storage_offset() != 0:
            return False
        if dest.device.type == "cpu" and dest.is_contiguous():
            self._read_into(offset, _byte_view(dest.detach()))
        else:  # another device (or layout): through one CPU tensor at a time, never all at once
            with torch.no_grad():
                dest.copy_(self._tensor(meta))
            self._storages.pop(offset, None)
        return True

    def fill_state_dict(self, state_dict: Mapping[str, Any], own: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """``state_dict`` (keys already matched to ``own``) with its tensors read into ``own``'s.

        Entries whose shape and dtype match the model's tensor are read into that tensor and
        replaced by it, so the ``load_state_dict`` that follows copies nothing; the others are
        read into new CPU tensors for ``load_state_dict`` to convert as usual.
        """
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            dest = own.get(key)
            if _is_lazy(value) and dest is not None and self._fill_one(value, dest):
                out[key] = dest
            else:
                out[key] = self.materialize(value)
        return out


def open_lazy(path: Path, size_bytes: int, load_skeleton: Any) -> LazyCheckpoint | None:
    """Open ``path`` for reading in place, or ``None`` when only the ordinary reader can read it.

    Args:
        path: a checkpoint file, already checked to be a regular file of ``size_bytes``.
        size_bytes: its size.
        load_skeleton: ``f(path) -> tree``, torch.load with ``map_location="meta"`` and
            gpukit's safety and error handling (``weights_only``).

    Raises:
        CheckpointError: the file is damaged, or a tensor's data disagrees with the zip record
            that should hold it (checked for every tensor before anything is read).
    """
    if sniff_format(path, size_bytes) != TORCH_ZIP:
        return None
    tree = load_skeleton(path)
    extents = _record_extents(path)
    if extents is None or not _all_located(tree, extents, path):
        return None
    return LazyCheckpoint(path, size_bytes, tree)


def _record_extents(path: Path) -> dict[int, int] | None:
    """Data offset -> size of every stored (uncompressed) tensor record of a torch zip file."""
    extents: dict[int, int] = {}
    with open(path, "rb") as handle, zipfile.ZipFile(handle) as archive:
        for info in archive.infolist():
            if "/data/" not in info.filename or info.filename.endswith("/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            handle.seek(info.header_offset)
            header = handle.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                return None
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            extents[info.header_offset + 30 + name_len + extra_len] = info.file_size
    return extents


def _all_located(tree: Any, extents: dict[int, int], path: Path) -> bool:
    """Whether every tensor in ``tree`` is a plain meta tensor lying exactly on its zip record."""
    if isinstance(tree, torch.Tensor):
        offset = _offset(tree) if tree.is_meta and tree.layout == torch.strided else None
        if offset is None:
            return False
        nbytes = tree.untyped_storage().nbytes()
        if extents.get(offset) != nbytes:
            raise CheckpointError(
                f"{path} is corrupted: a tensor claims {nbytes:,} bytes at offset {offset:,}, which is "
                "not where the archive stores tensor data of that size. Use an older checkpoint."
            )
        return True
    if isinstance(tree, Mapping):
        return all(_all_located(v, extents, path) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(_all_located(v, extents, path) for v in tree)
    return True
