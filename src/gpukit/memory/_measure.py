"""Measure the real peak memory of training steps: the ground truth the planner is held to."""

from __future__ import annotations

from typing import Any

import torch

from gpukit.accelerators import get_accelerator
from gpukit.errors import DeviceError
from gpukit.memory._measure_cpu import _cast_floats, _tensors, summed_output
from gpukit.memory._planner import OPTIMIZERS
from gpukit.placement import to_device
from gpukit.precision import Precision, get_precision

__all__ = ["measure_peak_memory"]


def measure_peak_memory(
    model: torch.nn.Module,
    example_batch: Any,
    *,
    precision: str = "32-true",
    optimizer: str = "adam",
    steps: int = 2,
    device: str | torch.device = "cuda",
) -> int:
    """Run ``steps`` real training steps on ``device`` and return the peak allocated bytes.

    Counted like :func:`estimate_memory` counts: everything the steps allocate on top of what
    was there before, plus the model's parameters and the batch (moved to ``device`` here).
    Library workspaces are warmed up first, as they are not the model's.

    Args:
        model: the model; it is moved to ``device`` and trained (pass a copy to keep it).
        example_batch: a tensor (``model(x)``), tuple (``model(*x)``) or dict (``model(**x)``), as
            :func:`~gpukit.memory.measure_step_memory` takes it; the loss is the sum of the means
            of the output's floating-point tensors (a Hugging Face ``ModelOutput`` included).
        precision: a gpukit precision name (autocast and weights as a Session would run them).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` or ``"none"``.
        steps: training steps (two: optimizer state exists from the second on).
        device: a device whose accelerator counts peak allocations (CUDA).

    Raises:
        DeviceError: the device does not count allocations (the CPU, MPS).
    """
    device = torch.device(device)
    accelerator = get_accelerator(device)
    precision_obj = get_precision(precision, accelerator, device)
    model = precision_obj.convert_module(model.to(device))
    batch = to_device(example_batch, device)
    if precision_obj.param_dtype != torch.float32:
        batch = _cast_floats(batch, precision_obj.param_dtype)
    opt_cls = OPTIMIZERS[optimizer]
    opt = opt_cls(model.parameters()) if opt_cls is not None else None
    _warm_up_workspaces(device, precision_obj)
    accelerator.synchronize(device)
    accelerator.reset_peak_memory_stats(device)
    before = accelerator.memory_stats(device)["allocated_bytes"]
    if before is None:
        raise DeviceError(f"measure_peak_memory needs a device that counts allocations (CUDA); got {device}.")
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *_tensors(batch)])
    for _ in range(steps):
        with precision_obj.autocast():
            loss = summed_output(model, batch)
        loss.backward()
        del loss
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    accelerator.synchronize(device)
    return accelerator.memory_stats(device)["peak_allocated_bytes"] - before + held


def _warm_up_workspaces(device: torch.device, precision: Precision) -> None:
    """Allocate the math libraries' per-process workspaces before the peak is measured.

    cuBLAS and cuBLASLt each keep a workspace per stream from their first call on (32 MiB each
    on Hopper with torch 2.11), taken from the caching allocator, so the first measurement in a
    process would count them as the model's: on an H100 the MLP's 32-true row read 103 MiB for a
    70 MiB plan when it ran first, and 1.5% off when it did not. A plain product warms cuBLAS; a
    linear layer with a bias (addmm) in each dtype the steps use warms cuBLASLt.
    """
    dtypes = {torch.float32, precision.param_dtype}
    for dtype in dtypes:
        x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
        b = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
        with precision.autocast():
            out = torch.nn.functional.linear(x, w, b) @ w
        out.float().sum().backward()
