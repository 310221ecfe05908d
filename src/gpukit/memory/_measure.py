"""Measure the real peak memory of training steps: the ground truth the planner is held to."""

from __future__ import annotations

import torch

from gpukit.accelerators import get_accelerator
from gpukit.errors import DeviceError
from gpukit.memory._planner import OPTIMIZERS
from gpukit.precision import get_precision

__all__ = ["measure_peak_memory"]


def measure_peak_memory(
    model: torch.nn.Module,
    example_batch: torch.Tensor,
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
        example_batch: one input tensor for ``model(x)``.
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
    batch = example_batch.to(device)
    opt_cls = OPTIMIZERS[optimizer]
    opt = opt_cls(model.parameters()) if opt_cls is not None else None
    warm = torch.ones(8, 8, device=device)
    warm @ warm  # cuBLAS workspace: allocated once per process, not part of a step
    accelerator.synchronize(device)
    accelerator.reset_peak_memory_stats(device)
    before = accelerator.memory_stats(device)["allocated_bytes"]
    if before is None:
        raise DeviceError(f"measure_peak_memory needs a device that counts allocations (CUDA); got {device}.")
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + batch.numel() * batch.element_size()
    for _ in range(steps):
        with precision_obj.autocast():
            loss = model(batch).float().mean()
        loss.backward()
        del loss
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    accelerator.synchronize(device)
    return accelerator.memory_stats(device)["peak_allocated_bytes"] - before + held
