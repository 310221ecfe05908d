"""The devices an inference plan may use and how much of each: ``max_memory`` as given, or what is
free now minus a stated margin (other users' processes respected: NVML's free memory counts them).

Keys of ``max_memory``: ``"cuda:N"`` (or a bare ``N``, as transformers takes), ``"cpu"``, ``"disk"``.
A plan uses disk only when ``"disk"`` is listed or an ``offload_dir`` is given: a model is never
sent to disk because nothing was said.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gpukit._util.units import format_bytes, parse_size
from gpukit.errors import ConfigurationError
from gpukit.inference._placement import CPU, DISK, GPU, DeviceBudget

__all__ = ["GPU_MARGIN_SHARE", "GPU_MARGIN_BYTES", "HOST_MARGIN_SHARE", "budgets", "describe_budgets"]

#: left free on each GPU by default: the CUDA context, library workspaces, fragmentation
GPU_MARGIN_BYTES = 1 * 2**30
GPU_MARGIN_SHARE = 0.10
#: left free of the host's available memory by default: the interpreter, torch, the OS
HOST_MARGIN_SHARE = 0.20


def _gpu_key(key: str | int) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    text = str(key).strip().lower()
    if text.startswith("cuda:"):
        text = text[5:]
    return int(text) if text.isdigit() else None


def budgets(max_memory: Mapping[str | int, str | int] | None, offload_dir: str | os.PathLike[str] | None,
            gpus_free_bytes: list[int] | None = None, host_available_bytes: int | None = None) -> list[DeviceBudget]:
    """The devices a plan places over, GPUs first in CUDA order, then ``cpu``, then ``disk``.

    Args:
        max_memory: bytes (or ``"20GiB"``) per device; ``None``: what is free now, less the margins.
        offload_dir: where disk-placed weights are read from or written to (lists ``disk`` by default).
        gpus_free_bytes: free bytes per visible GPU (default: NVML now, through ``gpukit.devices``).
        host_available_bytes: the host's available memory (default: psutil now).

    Raises:
        ConfigurationError: an unknown key or a size that is not one.
    """
    if max_memory is not None:
        return _given(max_memory, offload_dir)
    free = _visible_free_bytes() if gpus_free_bytes is None else gpus_free_bytes
    out = [DeviceBudget(f"cuda:{i}", GPU, max(0, int(f * (1 - GPU_MARGIN_SHARE)) - GPU_MARGIN_BYTES))
           for i, f in enumerate(free)]
    host = _host_available_bytes() if host_available_bytes is None else host_available_bytes
    out.append(DeviceBudget("cpu", CPU, int(host * (1 - HOST_MARGIN_SHARE))))
    if offload_dir is not None:
        out.append(DeviceBudget("disk", DISK, None))
    return out


def _given(max_memory: Mapping[str | int, str | int], offload_dir: str | os.PathLike[str] | None) -> list[DeviceBudget]:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ConfigurationError(f"max_memory={max_memory!r}: expected a dict such as {{'cuda:0': '20GiB', "
                                 "'cpu': '64GiB', 'disk': '500GiB'}} (or None: what is free now).")
    gpus: dict[int, DeviceBudget] = {}
    cpu = disk = None
    for key, value in max_memory.items():
        size = parse_size(value)
        index = _gpu_key(key)
        if index is not None:
            gpus[index] = DeviceBudget(f"cuda:{index}", GPU, size)
        elif str(key).strip().lower() == "cpu":
            cpu = DeviceBudget("cpu", CPU, size)
        elif str(key).strip().lower() == "disk":
            disk = DeviceBudget("disk", DISK, size)
        else:
            raise ConfigurationError(f"max_memory key {key!r}: expected 'cuda:N' (or N), 'cpu' or 'disk'.")
    if disk is None and offload_dir is not None:
        disk = DeviceBudget("disk", DISK, None)
    return [gpus[i] for i in sorted(gpus)] + [d for d in (cpu, disk) if d is not None]


def _visible_free_bytes() -> list[int]:
    """Free bytes of each GPU CUDA will number here (NVML: every process's use counted)."""
    from gpukit.devices import list_gpus, resolve_visible, silence_notice

    silence_notice()
    visible = resolve_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), list_gpus())
    return [g.memory_free_bytes or 0 for g in visible if g.usable]


def _host_available_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def describe_budgets(devices: list[DeviceBudget]) -> str:
    """``cuda:0 20.00 GiB, cpu 64.00 GiB, disk unlimited``."""
    return ", ".join(f"{d.name} {format_bytes(d.budget_bytes) if d.budget_bytes is not None else 'unlimited'}"
                     for d in devices)
