"""Warn when a model runs inference with gradients enabled and memory grows because of it.

``model.eval()`` changes dropout and batch norm; it does not stop autograd. A forward pass in
eval mode under grad mode records a graph and keeps every activation it saved for as long as
the output lives -- so an evaluation loop that keeps predictions piles up graphs. The guard is a
pair of forward hooks: cheap (a weak reference per eval forward), and silent unless outputs
with graphs actually accumulate or device memory rises forward after forward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from gpukit._util.warnings import warn_at_user_code
from gpukit.accelerators import get_accelerator
from gpukit.memory._leaks import MemoryLeakWarning

__all__ = ["InferenceGradWarning", "InferenceGuard", "inference_guard"]


class InferenceGradWarning(MemoryLeakWarning):
    """Inference ran with gradients enabled and kept autograd graphs alive."""


class InferenceGuard:
    """Forward hooks on one model; remove with :meth:`remove` or use as a context manager.

    Args:
        model: the module to watch (its top level forward only).
        max_live_outputs: warn once this many eval-mode outputs with graphs are alive at once.
        growth_streak: ...or once device memory after an eval-mode forward rose this many
            times in a row (accelerators only; CPU memory is not sampled per forward).
    """

    def __init__(self, model: torch.nn.Module, *, max_live_outputs: int = 3, growth_streak: int = 3) -> None:
        self.model = model
        self.max_live_outputs = max_live_outputs
        self.growth_streak = growth_streak
        self.warned = False
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._last_allocated: int | None = None
        self._streak = 0
        self._handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.warned or module.training or not torch.is_grad_enabled():
            return
        with_graph = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not with_graph:
            return
        self._outputs = [ref for ref in self._outputs if ref() is not None]
        self._outputs.append(weakref.ref(with_graph[0]))
        device = with_graph[0].device
        if device.type != "cpu":
            allocated = get_accelerator(device).memory_stats(device).get("allocated_bytes")
            if allocated is not None and self._last_allocated is not None:
                self._streak = self._streak + 1 if allocated > self._last_allocated else 0
            self._last_allocated = allocated
        if len(self._outputs) >= self.max_live_outputs or self._streak >= self.growth_streak:
            self.warned = True
            warn_at_user_code(
                InferenceGradWarning(
                    f"{type(module).__name__} ran in eval mode with gradients enabled, and its outputs keep "
                    f"their autograd graphs alive ({len(self._outputs)} outputs with graphs live at once): "
                    "memory grows with every batch. Fix: run inference under `with torch.no_grad():` or "
                    "`with torch.inference_mode():` (or store `out.detach()`)."
                )
            )

    def remove(self) -> None:
        self._handle.remove()
        self._outputs.clear()

    def __enter__(self) -> InferenceGuard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def inference_guard(model: torch.nn.Module, **options: Any) -> InferenceGuard:
    """Install an :class:`InferenceGuard` on ``model`` (``with inference_guard(model): ...``).

    Session installs one on each model it sets up and removes it at teardown.
    """
    return InferenceGuard(model, **options)
