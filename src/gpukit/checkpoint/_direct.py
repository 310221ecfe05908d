"""A model's weights read from a file straight into the model: ``load_state_dict(model, path)``.

``torch.load`` then ``model.load_state_dict`` reads every tensor into new memory and copies it
again into the model, so the weights are briefly held twice. Given a model and a path, gpukit
reads the file as ``session.resume`` does (``_lazy.py``): a torch zip checkpoint is opened
without reading its tensors (``weights_only``), the keys and shapes are checked against the
model (grouped errors, nothing overwritten on a mismatch), and each tensor's bytes go from the
file into the model's own parameter or buffer -- one ``preadv`` in CPU memory, one tensor at a
time through the CPU for another device. A safetensors file goes the same way: its header gives
every tensor's place in the file.
Files only the ordinary reader can read (legacy pickles) are loaded whole first.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpukit.checkpoint._formats import SAFETENSORS, check_readable_file, sniff_format
from gpukit.checkpoint._lazy import LazyCheckpoint
from gpukit.checkpoint._prefixes import match_state_dict
from gpukit.checkpoint._read import load_lazy
from gpukit.checkpoint._tensor_files import safetensors_entries

__all__ = ["load_state_dict", "load_into"]


def load_state_dict(model: nn.Module, state_dict: Mapping[str, Any] | str | os.PathLike[str], strict: bool = True,
                    *, trust: bool = False) -> Any:
    """Load ``state_dict`` into ``model``, whatever wrapper prefixes either side has.

    Args:
        model: a plain, DataParallel-, DistributedDataParallel- or torch.compile-wrapped model.
        state_dict: keys with or without ``module.`` / ``_orig_mod.`` prefixes, in any
            combination; or the path of a file holding one (torch or safetensors), whose tensors
            are then read straight into the model's own (no second copy of the weights; see
            this module's docstring), checked first as ``gpukit.load`` checks files.
        strict: require every model key and only model keys (as ``nn.Module.load_state_dict``).
        trust: for a path: allow full unpickling (files from a source you trust only).

    Returns:
        torch's ``_IncompatibleKeys(missing_keys, unexpected_keys)``, in unwrapped key names.

    Raises:
        ConfigurationError: ``state_dict`` is neither a mapping nor a path, or
            is a whole training state (``{"model": {...}, "optimizer": {...}, ...}``).
        StateDictMismatchError: missing or unexpected keys (with ``strict``), or shape
            mismatches (always), listed grouped, with the prefixes and wrappers detected.
    """
    if isinstance(state_dict, str) or hasattr(state_dict, "__fspath__"):
        return load_into(model, state_dict, strict=strict, trust=trust)  # type: ignore[arg-type]
    inner, remapped, _ = match_state_dict(model, state_dict, strict)  # type: ignore[arg-type]
    return inner.load_state_dict(remapped, strict=strict)


def load_into(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True, trust: bool = False) -> Any:
    """Load the state dict in ``path`` into ``model`` without a second copy of the weights.

    Returns:
        torch's ``_IncompatibleKeys`` (unwrapped key names), as ``load_state_dict`` does.

    Raises:
        CheckpointError, UnsafeCheckpointError: as :func:`gpukit.load` for the file.
        ConfigurationError: the file holds a whole training state, not a model's state dict.
        StateDictMismatchError: the model does not fit the file (before anything is loaded).
    """
    source = Path(path)
    size = check_readable_file(source)
    if sniff_format(source, size) == SAFETENSORS:
        return _from_safetensors(model, source, size, strict)
    with load_lazy(source, trust=trust) as lazy:
        inner, remapped, own = match_state_dict(model, lazy.tree, strict=strict)  # shapes only: nothing read yet
        filled = OrderedDict(lazy.fill_state_dict(remapped, own))
        if hasattr(remapped, "_metadata"):
            filled._metadata = remapped._metadata  # type: ignore[attr-defined]
        return inner.load_state_dict(filled, strict=strict)


def _from_safetensors(model: nn.Module, path: Path, size: int, strict: bool) -> Any:
    """A safetensors file read as a torch one is: its header gives every tensor's place in the
    file, and the same in-place reader (``LazyCheckpoint``) reads each one into the model's."""
    tree = safetensors_entries(path, size)  # refuses absurd sizes and offsets before anything is read
    with LazyCheckpoint(path, size, tree) as lazy:
        inner, remapped, own = match_state_dict(model, tree, strict=strict)
        return inner.load_state_dict(OrderedDict(lazy.fill_state_dict(remapped, own)), strict=strict)
