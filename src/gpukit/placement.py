"""Placement: resolve a device, move nested data onto it, unwrap wrapped models.

``resolve_device`` turns what users write ("auto", "cuda:1", 0, a ``torch.device``) into a
checked ``torch.device``; ``to_device`` moves tensors and modules inside any nesting of dicts,
lists, tuples, named tuples and dataclasses; ``unwrap_model`` strips DataParallel,
DistributedDataParallel and ``torch.compile`` wrappers so state dicts have clean keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from gpukit.accelerators import (
    DEVICE_TYPES,
    Accelerator,
    auto_device_type,
    get_accelerator,
)
from gpukit.errors import ConfigurationError, DeviceError

__all__ = ["resolve_device", "to_device", "device_mover", "unwrap_model", "visible_mapping_text"]

T = TypeVar("T")

_ALLOWED = '"auto", "cpu", "cuda", "cuda:N", "mps", an int N (GPU N), or a torch.device'


def resolve_device(spec: str | int | torch.device = "auto") -> torch.device:
    """Turn a device spec into a checked ``torch.device``.

    Args:
        spec: "auto" (best available: first GPU, then MPS, then CPU), "cpu", "cuda" (GPU 0),
            "cuda:N", "mps", an int N (logical GPU N), or a ``torch.device``.

    Returns:
        The device, with an explicit index for GPUs ("cuda" becomes ``cuda:0``).

    Raises:
        ConfigurationError: ``spec`` is not a device spec.
        DeviceError: the device type is not available here, or the index is past the number
            of visible devices (the message shows the logical -> physical GPU mapping).
    """
    if isinstance(spec, bool):  # bool is an int subclass; True is never meant as "GPU 1"
        raise ConfigurationError(f"Device spec {spec!r} is not a device; use {_ALLOWED}.")
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        spec = auto_device_type()
    if isinstance(spec, int):
        if spec < 0:
            raise ConfigurationError(f"Device index {spec} is negative; use {_ALLOWED}.")
        device = torch.device(_gpu_type(), spec)
    elif isinstance(spec, torch.device):
        device = spec
    elif isinstance(spec, str):
        try:
            device = torch.device(spec.strip().lower())
        except RuntimeError:
            raise ConfigurationError(f"Unknown device {spec!r}; use {_ALLOWED}.") from None
    else:
        raise ConfigurationError(
            f"Device spec of type {type(spec).__name__} ({spec!r}) is not supported; use {_ALLOWED}."
        )
    if device.type not in DEVICE_TYPES:
        raise ConfigurationError(f"Unknown device {str(device)!r}; use {_ALLOWED}.")
    accelerator = get_accelerator(device)
    return _check_available(device, accelerator)


def _gpu_type() -> str:
    """The device type a bare GPU index refers to (CUDA where present)."""
    auto = auto_device_type()
    return "cuda" if auto == "cpu" else auto  # on a CPU box the CUDA check below explains


def _check_available(device: torch.device, accelerator: Accelerator) -> torch.device:
    if not accelerator.is_available():
        raise DeviceError(
            f"Device {str(device)!r} was asked for, but no {device.type} device is available in "
            f"this process (best available: {auto_device_type()!r}). Use devices='auto' or 'cpu', "
            "or check the driver and CUDA_VISIBLE_DEVICES."
        )
    count = accelerator.device_count()
    index = device.index
    if accelerator.is_host:
        # one CPU device: "cpu:0" and "cpu" are the same place; "cpu:1" does not exist
        if index not in (None, 0):
            raise DeviceError(f"Device {str(device)!r} does not exist; the CPU is 'cpu'.")
        return accelerator.device()
    if index is None:
        index = 0
    if index >= count:
        mapping = visible_mapping_text()
        raise DeviceError(
            f"Device {str(device)!r} was asked for, but only {count} {device.type} device(s) are "
            f"visible to this process (valid: {device.type}:0..{device.type}:{count - 1}). "
            "Indices are logical: CUDA_VISIBLE_DEVICES renumbers the GPUs it lists from 0."
            + (f"\nVisible GPUs:\n{mapping}" if mapping else "")
            + "\nPick a lower index, or change CUDA_VISIBLE_DEVICES (e.g. `gpukit select`)."
        )
    return accelerator.device(index)


def visible_mapping_text() -> str:
    """``gpukit.devices.describe_mapping()``, or "" when the devices layer cannot say.

    Only used to enrich error messages, so any failure (no driver, no NVML) yields "".
    """
    try:
        from gpukit.devices import describe_mapping

        return str(describe_mapping()).strip()
    except Exception:  # noqa: BLE001 - an error message must never fail while being built
        return ""


def to_device(obj: T, device: str | int | torch.device) -> T:
    """Move tensors and modules inside ``obj`` to ``device``; leave other leaves alone.

    Handles dicts (and other mappings), lists, tuples, named tuples, dataclasses and anything
    with a ``.to`` method. Copies from pinned host memory to a GPU are ``non_blocking``.

    Args:
        obj: a tensor, module, or nested structure of them.
        device: where to move it (anything ``resolve_device`` accepts, or a torch.device,
            which is used as given).

    Returns:
        The same structure with moved leaves (modules are moved in place and returned).
    """
    return device_mover(device)(obj)


def device_mover(device: str | int | torch.device) -> Callable[[Any], Any]:
    """``to_device`` with the device resolved once: ``move = device_mover(d)``, then ``move(batch)``
    per batch (what a loader does, without re-resolving the device every step)."""
    if not isinstance(device, torch.device):
        device = resolve_device(device)
    # Only a pinned source makes an async copy safe and useful, and only to a GPU.
    try:
        async_ok = get_accelerator(device).benefits_from_pinned_memory
    except ConfigurationError:  # e.g. "meta": a valid torch device gpukit does not manage
        async_ok = False
    target: torch.device = device
    if target.type != "cpu":
        return lambda obj: _move(obj, target, async_ok)

    def to_host(obj: Any) -> Any:
        # the usual batch on the host: a tuple/list of CPU tensors, already where it goes
        if type(obj) in (tuple, list):
            for t in obj:  # a plain loop: all() over a generator costs ~1 us a batch here
                if type(t) is not torch.Tensor or not t.is_cpu:
                    return _move(obj, target, async_ok)
            return obj
        return _move(obj, target, async_ok)

    return to_host


def _move(obj: Any, device: torch.device, async_ok: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        non_blocking = async_ok and obj.device.type == "cpu" and obj.is_pinned()
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, nn.Module):
        return obj.to(device)
    if isinstance(obj, (str, bytes)) or obj is None:
        return obj
    if isinstance(obj, Mapping):
        moved = {k: _move(v, device, async_ok) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)  # OrderedDict, defaultdict-free mappings, BatchEncoding...
        except TypeError:
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(_move(v, device, async_ok) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device, async_ok) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _move_dataclass(obj, device, async_ok)
    to = getattr(obj, "to", None)
    if callable(to):
        return to(device)
    return obj


def _move_dataclass(obj: Any, device: torch.device, async_ok: bool) -> Any:
    fields = dataclasses.fields(obj)
    init = {f.name: _move(getattr(obj, f.name), device, async_ok) for f in fields if f.init}
    new = dataclasses.replace(obj, **init)
    for f in fields:
        if not f.init and hasattr(obj, f.name):
            # frozen dataclasses refuse setattr; object.__setattr__ is how they set themselves
            object.__setattr__(new, f.name, _move(getattr(obj, f.name), device, async_ok))
    return new


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DataParallel, DistributedDataParallel, ``torch.compile`` and gpukit's
    ``split`` wrappers.

    Wrappers may be nested in any order (``torch.compile(DDP(model))`` and
    ``DDP(torch.compile(model))`` both give ``model``).

    Args:
        model: a module, wrapped or not.

    Returns:
        The innermost module; ``model`` itself when it is not wrapped.
    """
    wrappers = (nn.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        elif getattr(type(model), "gpukit_wraps_module", False):  # gpukit.parallel.split
            model = model.module
        else:
            return model
