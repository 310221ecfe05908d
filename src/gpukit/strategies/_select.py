"""Turn ``Session(devices=..., strategy=..., accelerator=...)`` into a Strategy object.

Rules (documented in docs/sessions.md, "Devices and strategies"):
- ``devices`` counts devices *per node*: "auto" (one per process: the local GPU under a
  launcher, else GPU 0 / MPS / CPU), an int N (-1: every visible GPU), a list of GPU indices,
  or one device spec ("cpu", "cuda:1", a torch.device).
- On the CPU, ``devices=N`` means N processes; ask for it explicitly with
  ``accelerator="cpu"`` (so ``devices=4`` on a box without GPUs is an error, not 4 CPU workers).
- ``strategy="pipeline"``: one process, the model's layers split over ``devices`` (a list of
  stage devices, or N / "auto" / -1 for the first N / every visible GPU).
- ``strategy="auto"``: several processes (launched, or to be launched) -> "ddp"; otherwise
  "single". "dp" is never chosen automatically: DDP is faster; ask for it by name. "fsdp"
  (sharded, one process per device) is placed as "ddp"; an unbound ``FSDPStrategy(...)``
  object carries its settings and is placed the same way.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpukit._util.warnings import user_stacklevel
from gpukit.accelerators import DEVICE_TYPES, Accelerator, auto_device_type, get_accelerator
from gpukit.errors import ConfigurationError, DeviceError
from gpukit.layout import StrategyEntry, strategy_entry, strategy_names
from gpukit.placement import resolve_device, visible_mapping_text
from gpukit.strategies._env import DistEnv
from gpukit.strategies.base import Strategy
from gpukit.strategies.fsdp import FSDPStrategy

__all__ = ["select_strategy", "STRATEGIES", "ACCELERATORS", "strategy_class"]

#: the names registered when gpukit was imported (``gpukit.layout.strategy_names()`` is the live list)
STRATEGIES = strategy_names()
ACCELERATORS = ("auto", *DEVICE_TYPES)
_DEVICES_HELP = (
    'devices="auto", an int N (-1 = all visible GPUs), a list of GPU indices, or one device '
    'such as "cpu" or "cuda:1"'
)


def select_strategy(
    devices: Any = "auto",
    strategy: str | Strategy = "auto",
    accelerator: str | Accelerator = "auto",
    *,
    sync_batchnorm: bool = False,
    environ: Mapping[str, str] | None = None,
    tensor_parallel: int | str = 1,
    tensor_plan: dict[str, Any] | None = None,
) -> Strategy:
    """The strategy for these settings in this process (``tensor_parallel > 1``: its layers split over
    groups of that many processes, see ``strategies/tensor.py``; ``"auto"``: the degree is chosen at
    setup by ``Session(fit=...)``, one process keeps its strategy).

    Raises:
        ConfigurationError: an unknown string or a contradictory combination.
        DeviceError: more devices than visible, or a device type that is not available.
        DistributedError: a malformed launch environment.
    """
    strategy = _placed(devices, strategy, accelerator, sync_batchnorm, environ)
    if tensor_parallel == 1 and tensor_plan is None:
        return strategy
    from gpukit.strategies.tensor import with_tensor_parallel

    if tensor_parallel == "auto":
        if strategy.world_size == 1 and not strategy.layout.one_process:  # one process: no group to split over
            return strategy
        return with_tensor_parallel(strategy, 1, tensor_plan, chosen_later=True)
    return with_tensor_parallel(strategy, tensor_parallel, tensor_plan)


def _placed(devices: Any, strategy: str | Strategy, accelerator: str | Accelerator, sync_batchnorm: bool,
            environ: Mapping[str, str] | None) -> Strategy:
    template: FSDPStrategy | None = None
    if isinstance(strategy, FSDPStrategy) and not strategy.bound:
        template, strategy = strategy, "fsdp"  # settings given, placement still to choose
    if isinstance(strategy, Strategy):
        return strategy
    name = str(strategy).strip().lower()
    entry = None if name == "auto" else strategy_entry(str(strategy))
    env = DistEnv.from_environ(environ)
    if entry is not None and entry.placement == "stages":
        return _pipeline(devices, accelerator, env, strategy_class(entry))
    acc = _accelerator(accelerator, devices)
    indices = _device_indices(devices, acc, env, accelerator_given=accelerator != "auto", environ=environ)
    if env is not None and not _is_auto(devices) and len(indices) != env.local_world_size:
        raise ConfigurationError(
            f"devices={devices!r} asks for {len(indices)} device(s) per node, but the launcher "
            f"started {env.local_world_size} process(es) per node (LOCAL_WORLD_SIZE). Make them "
            "agree, or use devices='auto' to take one device per launched process."
        )
    processes = env.world_size if env is not None else len(indices)
    if entry is None:
        entry = strategy_entry("ddp" if processes > 1 else "single")
    name, cls = entry.name, strategy_class(entry)
    if entry.placement == "one-device":
        if processes > 1:
            raise ConfigurationError(
                f"strategy={name!r} uses one device, but {processes} were asked for "
                f"(devices={devices!r}{', WORLD_SIZE=' + str(env.world_size) if env else ''}). "
                "Use strategy='ddp' (or 'dp' for several GPUs in one process), or devices=1."
            )
        return cls(acc, _device(acc, indices[0]))
    if entry.placement == "in-process":
        if env is not None and env.world_size > 1:
            raise ConfigurationError(
                f"strategy={name!r} runs in one process, but this is rank {env.rank} of "
                f"{env.world_size} launched processes; use strategy='ddp' (or 'auto')."
            )
        if acc.is_host and len(indices) > 1:
            raise ConfigurationError(
                f"strategy={name!r} splits batches over GPUs; the CPU is one device (devices={devices!r}). "
                "Use devices=1, or accelerator='cpu' with strategy='ddp' for several CPU processes."
            )
        return cls(acc, [_device(acc, i) for i in indices])
    local = _device(acc, indices[env.local_rank] if env is not None else indices[0])
    shared = _processes_share_one_gpu(devices, acc, env)
    if template is not None:
        return template.place(acc, local, env, len(indices), shares_gpu=shared)
    return cls.for_process(acc, local, env, len(indices), sync_batchnorm=sync_batchnorm, shares_gpu=shared)


def strategy_class(entry: StrategyEntry) -> Any:
    """The ``Strategy`` subclass a registry entry names (its module imported on first use).

    Raises:
        ConfigurationError: the entry's target is not an importable ``Strategy`` subclass.
    """
    module_name, _, class_name = entry.target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"strategy {entry.name!r}: cannot import {entry.target!r} ({exc}).") from exc
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigurationError(f"strategy {entry.name!r}: {entry.target!r} is not a gpukit Strategy subclass.")
    return cls


def _processes_share_one_gpu(devices: Any, acc: Accelerator, env: DistEnv | None) -> bool:
    """Several processes on this node, one visible GPU, and nothing gave each process its own.

    A launcher starts its local workers with one environment (``gpukit run --gpus 1 --nproc 2``,
    torchrun on a one-GPU machine, a pod with one GPU): they all see the same GPU. Only a
    scheduler binds a GPU per task, and under SLURM that case is told apart (and a shared
    GPU refused) in :func:`_device_indices`.
    """
    return (env is not None and env.local_world_size > 1 and not acc.is_host and _is_auto(devices)
            and env.kind != "slurm" and acc.device_count() == 1)


def _pipeline(devices: Any, accelerator: str | Accelerator, env: DistEnv | None, cls: Any) -> Strategy:
    if env is not None and env.world_size > 1:
        raise ConfigurationError(
            f"strategy='pipeline' splits the model over devices in one process, but this is rank "
            f"{env.rank} of {env.world_size} launched processes; start one process (python script.py)."
        )
    if _is_auto(devices) or (isinstance(devices, int) and not isinstance(devices, bool)):
        acc = _accelerator(accelerator, devices)
        if acc.is_host:
            raise ConfigurationError(
                f"strategy='pipeline' with devices={devices!r} puts stages on GPUs, but none is "
                "visible; name the stage devices, e.g. devices=['cpu', 'cpu'] (CPU stages, for testing)."
            )
        count = acc.device_count() if _is_auto(devices) or devices == -1 else devices
        if count < 1:
            raise ConfigurationError(f"devices={devices} is not a device count; use {_DEVICES_HELP}.")
        devices = [acc.device(i) for i in _checked(list(range(count)), acc, devices)]
    strategy = cls(devices)
    given = accelerator.type if isinstance(accelerator, Accelerator) else str(accelerator).strip().lower()
    if given != "auto" and given != strategy.accelerator.type:
        raise ConfigurationError(
            f"strategy='pipeline': devices are {strategy.accelerator.type} devices but accelerator "
            f"is {given!r}; drop one of them."
        )
    return strategy


def _accelerator(accelerator: str | Accelerator, devices: Any) -> Accelerator:
    if isinstance(accelerator, Accelerator):
        acc = accelerator
    else:
        key = str(accelerator).strip().lower()
        if key not in ACCELERATORS:
            raise ConfigurationError(
                f"Unknown accelerator {accelerator!r}; choose one of "
                f"{', '.join(map(repr, ACCELERATORS))}."
            )
        if key == "auto":
            if isinstance(devices, (str, torch.device)) and not _is_auto(devices):
                return get_accelerator(resolve_device(devices))
            key = auto_device_type()
        acc = get_accelerator(key)
    if not acc.is_available():
        raise DeviceError(
            f"accelerator {acc.type!r} was asked for but is not available here "
            f"(best available: {auto_device_type()!r}). Use accelerator='auto'."
        )
    return acc


def _device_indices(
    devices: Any, acc: Accelerator, env: DistEnv | None, *, accelerator_given: bool,
    environ: Mapping[str, str] | None = None,
) -> list[int | None]:
    """Device indices on this node (``None`` for the CPU, where each entry is a process)."""
    if isinstance(devices, bool):
        raise ConfigurationError(f"devices={devices!r} is not a device count; use {_DEVICES_HELP}.")
    if _is_auto(devices):
        count = env.local_world_size if env is not None else 1
        if env is not None and count > 1 and not acc.is_host and acc.device_count() == 1:
            # The launcher or scheduler gave each process a GPU of its own (a per-task
            # CUDA_VISIBLE_DEVICES, e.g. SLURM --gpus-per-task=1): every rank uses its cuda:0 --
            # unless SLURM gave the node fewer GPUs than tasks: then they all see the same one
            if env.kind == "slurm":
                from gpukit.cluster import shared_gpu_problem

                problem = shared_gpu_problem(count, 1, os.environ if environ is None else environ)
                if problem:
                    raise DeviceError(problem)
            return [0] * count
        if env is not None and env.kind == "slurm" and not acc.is_host:
            _check_slurm_tasks(count, acc.device_count())
        return _checked(list(range(count)), acc, devices)
    if isinstance(devices, (str, torch.device)):
        device = resolve_device(devices)
        if device.type != acc.type:
            raise ConfigurationError(
                f"devices={str(devices)!r} is a {device.type} device but accelerator is "
                f"{acc.type!r}; drop one of them."
            )
        return [device.index]
    if isinstance(devices, int):
        if devices == -1:
            count = env.local_world_size if env is not None and acc.is_host else acc.device_count()
        elif devices >= 1:
            count = devices
        else:
            raise ConfigurationError(f"devices={devices} is not a device count; use {_DEVICES_HELP}.")
        if count > 1 and acc.is_host and not accelerator_given:
            raise DeviceError(
                f"devices={devices} asks for {count} devices, but no GPU is visible to this "
                "process. For several CPU processes (DDP on gloo) say so: "
                f"Session(accelerator='cpu', devices={count})."
            )
        return _checked(list(range(count)), acc, devices)
    if isinstance(devices, Sequence) and devices and all(
        isinstance(i, int) and not isinstance(i, bool) for i in devices
    ):
        if acc.is_host:
            raise ConfigurationError(
                f"devices={list(devices)!r} lists GPU indices, but there is no GPU here; "
                "use accelerator='cpu', devices=N for N CPU processes."
            )
        if len(set(devices)) != len(devices):
            raise ConfigurationError(f"devices={list(devices)!r} lists a GPU twice.")
        return _checked(list(devices), acc, devices)
    raise ConfigurationError(f"devices={devices!r} is not understood; use {_DEVICES_HELP}.")


def _check_slurm_tasks(tasks: int, gpus: int) -> None:
    """``srun --ntasks-per-node`` against the GPUs each task sees: refuse sharing, warn of idle GPUs."""
    from gpukit.cluster import gpu_mismatch

    problem = gpu_mismatch(tasks, gpus)
    if problem and tasks > gpus:
        raise DeviceError(problem)
    if problem:
        warnings.warn(problem, RuntimeWarning, stacklevel=user_stacklevel())


def _checked(indices: list[int], acc: Accelerator, given: Any) -> list[int | None]:
    if acc.is_host:
        return [None] * len(indices)
    count = acc.device_count()
    if max(indices) >= count or min(indices) < 0:
        mapping = visible_mapping_text()
        raise DeviceError(
            f"devices={given!r} needs {acc.type} device(s) {indices}, but only {count} "
            f"{'is' if count == 1 else 'are'} visible to this process."
            + (f"\nVisible GPUs:\n{mapping}" if mapping else "")
            + "\nAsk for fewer, or change CUDA_VISIBLE_DEVICES (`gpukit ls` shows them)."
        )
    return list(indices)


def _device(acc: Accelerator, index: int | None) -> torch.device:
    return acc.device(index) if index is not None else acc.device()


def _is_auto(devices: Any) -> bool:
    return isinstance(devices, str) and devices.strip().lower() == "auto"
