"""The planner's simulated step: the model on fake parameters (in backward too, where
checkpointed blocks run their forward again), with checkpointing and a "-true" precision's
casts applied for the simulation only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gpukit.memory._activation import checkpointing_applied
from gpukit.precision import NORM_LAYERS, _cast_hook, _cast_output_hook

__all__ = ["norm_tensor_names", "simulated", "true_precision_casts"]


@contextlib.contextmanager
def simulated(
    model: torch.nn.Module, state: dict[str, torch.Tensor], checkpointing: Any, low: torch.dtype | None,
) -> Iterator[list[str]]:
    """``model`` running on the fake ``state`` -- for backward too, where checkpointed blocks
    run their forward again -- with ``checkpointing`` applied; all undone afterwards."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, state), checkpointing_applied(model, checkpointing) as names, \
            true_precision_casts(model, low):
        yield names


def norm_tensor_names(model: torch.nn.Module) -> set[str]:
    """Parameters and buffers of the norm layers a "-true" precision keeps in fp32."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in model.named_modules() if isinstance(sub, NORM_LAYERS)
            for name, _ in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]}


@contextlib.contextmanager
def true_precision_casts(model: torch.nn.Module, low: torch.dtype | None) -> Iterator[None]:
    """The casts ``TruePrecision.convert_module`` adds (fp32 norm layers; fp32 outputs), for the
    simulation only: they copy activations, which the plan must count."""
    if low is None or getattr(model, "_gpukit_precision", None) is not None:
        yield  # no "-true" precision, or the model was converted already (its hooks run)
        return
    handles = []
    for sub in model.modules():
        if isinstance(sub, NORM_LAYERS):
            handles.append(sub.register_forward_pre_hook(_cast_hook(torch.float32), with_kwargs=True))
            handles.append(sub.register_forward_hook(_cast_output_hook(low)))
    handles.append(model.register_forward_hook(_cast_output_hook(torch.get_default_dtype())))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
