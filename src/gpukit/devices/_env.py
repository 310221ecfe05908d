"""Pointing CUDA at GPUs: ``CUDA_VISIBLE_DEVICES`` + ``CUDA_DEVICE_ORDER``, and the guard that makes it count.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises; setting it afterwards is silently
ignored. So :func:`use_gpus` refuses to change it in a process whose CUDA is already initialised.
"""

from __future__ import annotations

import os
import sys
from typing import Any, MutableMapping, Sequence

from gpukit._util.units import whole_number
from gpukit.devices._snapshot import GpuSnapshot, list_gpus, selectable_units
from gpukit.devices._visible import ENV_VAR
from gpukit.errors import ConfigurationError, CudaAlreadyInitializedError, DeviceError

__all__ = ["cuda_initialized", "use_gpus"]

ORDER_VAR = "CUDA_DEVICE_ORDER"


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA through torch.

    Looks only at modules already imported (``sys.modules``): it never imports torch and never
    initialises CUDA itself.
    """
    torch_cuda = sys.modules.get("torch.cuda")
    if torch_cuda is None:
        torch = sys.modules.get("torch")
        torch_cuda = getattr(torch, "cuda", None) if torch is not None else None
    is_initialized = getattr(torch_cuda, "is_initialized", None)
    if is_initialized is None:
        return False
    try:
        return bool(is_initialized())
    except Exception:  # a half-imported or stubbed torch: it cannot have initialised CUDA
        return False


def _entry(gpu: Any, units: list[GpuSnapshot] | None) -> str:
    if isinstance(gpu, GpuSnapshot):
        return gpu.uuid or "" if gpu.is_mig else str(gpu.index)
    if isinstance(gpu, bool):
        raise ConfigurationError(f"Cannot use GPU {gpu!r}: give indices, UUIDs or snapshots.")
    if isinstance(gpu, str) and whole_number(gpu) is not None:
        gpu = whole_number(gpu)
    if isinstance(gpu, int):
        if gpu < 0:
            raise ConfigurationError(f"Cannot use GPU {gpu}: indices start at 0 (nvidia-smi numbering).")
        if units is not None and not any(u.index == gpu for u in units):
            raise DeviceError(f"Cannot use GPU {gpu}: there is no such GPU. {_known(units)}")
        return str(gpu)
    if isinstance(gpu, str) and gpu.startswith(("GPU-", "MIG-")):
        if units is not None:
            hits = [u for u in units if (u.uuid or "").lower().startswith(gpu.lower())
                    or (u.mig_parent_uuid or "").lower().startswith(gpu.lower()) and gpu.startswith("GPU-")]
            if not hits:
                raise DeviceError(f"Cannot use GPU {gpu!r}: no GPU has that UUID. {_known(units)}")
        return gpu
    raise ConfigurationError(
        f"Cannot use GPU {gpu!r}: give an index as nvidia-smi shows it (0, 1, ...), a UUID starting with "
        "'GPU-' or 'MIG-', or a snapshot from list_gpus()/select_gpus().")


def _known(units: list[GpuSnapshot]) -> str:
    return "GPUs here: " + (", ".join(f"{u.label} {u.uuid}" for u in units) or "none") + "."


def use_gpus(gpus: Sequence[int | str | GpuSnapshot] | Any, *,
             env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Make CUDA use exactly ``gpus``, numbered like ``nvidia-smi``.

    Sets ``CUDA_VISIBLE_DEVICES`` (physical indices; MIG devices by ``MIG-`` id; UUID strings as
    given) and ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so that ``cuda:0`` is the first GPU given and
    physical indices mean what ``nvidia-smi`` shows. Call it before anything initialises CUDA.

    Args:
        gpus: snapshots (from ``select_gpus``), a ``GpuClaim``, indices, or UUIDs. An empty list
            hides every GPU.
        env: the mapping to change (e.g. a child process's environment); default ``os.environ``,
            which is checked against this process's CUDA state.

    Returns:
        The variables set, e.g. ``{"CUDA_VISIBLE_DEVICES": "3,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}``.

    Raises:
        CudaAlreadyInitializedError: changing ``os.environ`` after this process initialised CUDA,
            which would be silently ignored.
        DeviceError: a GPU that does not exist (checked when the driver is present).
        ConfigurationError: something that is not a GPU id, or a GPU given twice.
    """
    gpus = getattr(gpus, "gpus", gpus)  # a GpuClaim
    if isinstance(gpus, (str, int, GpuSnapshot)):
        gpus = [gpus]
    snapshot = list_gpus() if any(not isinstance(g, GpuSnapshot) for g in gpus) else None
    units = None if not snapshot else [*selectable_units(snapshot), *snapshot]
    if snapshot is not None and not snapshot and gpus:
        from gpukit.devices import _nvml

        raise DeviceError(f"Cannot use GPUs {list(gpus)!r}: {_nvml.unavailable_reason() or 'no NVIDIA GPU found'}.")
    entries = [_entry(g, units) for g in gpus]
    value = ",".join(entries)
    if len(set(entries)) != len(entries):
        raise ConfigurationError(f"GPUs {value!r} name a GPU twice; CUDA would then hide every GPU.")
    wanted = {ENV_VAR: value, ORDER_VAR: "PCI_BUS_ID"}
    target: MutableMapping[str, str] = os.environ if env is None else env
    if target is os.environ and cuda_initialized() and any(os.environ.get(k) != v for k, v in wanted.items()):
        raise CudaAlreadyInitializedError(
            f"Cannot set {ENV_VAR}={value!r}: CUDA is already initialised in this process "
            f"(it was started with {ENV_VAR}={os.environ.get(ENV_VAR)!r}), so the change would be silently "
            "ignored. Call use_gpus() (or select GPUs with `gpukit run` / `gpukit select`) before the first "
            "CUDA call, or pass env= to prepare a child process's environment.")
    target.update(wanted)
    return dict(wanted)
