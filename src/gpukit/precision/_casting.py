"""Casting the floating tensors inside a module's inputs or outputs, keeping every container its own type."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import MutableMapping
from typing import Any

import torch
from torch import nn

__all__ = ["cast_inputs_hook", "cast_outputs_hook"]


def _cast(obj: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None) -> Any:
    """``obj`` with its floating-point tensors (those of a dtype in ``only``, when given) cast to
    ``dtype``, every container kept as its own type: a Hugging Face ``ModelOutput`` stays one
    (``model(**batch).loss`` still works), and so do namedtuples, dataclasses and dict/list subclasses."""
    if isinstance(obj, torch.Tensor):
        wanted = obj.is_floating_point() if only is None else obj.dtype in only
        return obj.to(dtype) if wanted else obj
    if isinstance(obj, MutableMapping):
        items = {k: _cast(v, dtype, only) for k, v in obj.items()}
        return items if type(obj) is dict else _same_mapping(obj, items)
    if isinstance(obj, (list, tuple)):
        values = [_cast(v, dtype, only) for v in obj]
        if type(obj) in (list, tuple):
            return type(obj)(values)
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments
            return type(obj)(*values)
        return _same_sequence(obj, values)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for field in dataclasses.fields(obj):  # object.__setattr__: frozen dataclasses too
            object.__setattr__(new, field.name, _cast(getattr(obj, field.name), dtype, only))
        return new
    return obj


def _same_mapping(obj: MutableMapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A copy of the mapping ``obj`` (its class, attributes and order) holding ``items``.

    ``ModelOutput`` keeps each key as an attribute too; its ``__setitem__`` sets both."""
    try:
        new = copy.copy(obj)
        for key, value in items.items():
            new[key] = value
        return new
    except Exception:  # noqa: BLE001 - a mapping that cannot be copied: build one from its items
        return type(obj)(items)


def _same_sequence(obj: list[Any] | tuple[Any, ...], values: list[Any]) -> Any:
    """``values`` in the list/tuple subclass of ``obj`` (built from an iterable, or a copy)."""
    try:
        return type(obj)(values)
    except TypeError:
        if isinstance(obj, list):
            new = copy.copy(obj)
            new[:] = values
            return new
        return tuple(values)


def cast_inputs_hook(dtype: torch.dtype) -> Any:
    """A forward pre-hook (``with_kwargs=True``) casting a module's floating inputs to ``dtype``
    (the '-true' precisions' norm layers and model input; the planner simulates the same)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _cast(args, dtype), _cast(kwargs, dtype)

    return hook


def cast_outputs_hook(dtype: torch.dtype) -> Any:
    """A forward hook casting a module's floating outputs to ``dtype`` (see :func:`cast_inputs_hook`)."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast(output, dtype)

    return hook
