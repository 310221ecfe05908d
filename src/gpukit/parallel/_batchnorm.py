"""BatchNorm under micro-batches.

In training mode a BatchNorm layer normalises each micro-batch with that micro-batch's own
mean and variance, and updates its running statistics once per micro-batch. With
``chunks=K`` the outputs therefore differ from the whole batch's (as they do under DDP without
SyncBatchNorm), and the running statistics take K momentum steps instead of one.

``deferred_batchnorm=True`` (the approach of torchgpipe's DeferredBatchNorm) keeps the
per-micro-batch normalisation but makes the running statistics those of the whole batch:
the layer's input sums are accumulated over the K micro-batches and the running mean,
variance and ``num_batches_tracked`` are set once, after the last one, exactly as one
forward over the whole batch would have left them. Evaluation mode uses the running
statistics and is unaffected by micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["has_training_batchnorm", "DeferredBatchNorm"]


def _tracked_batchnorms(modules: list[nn.Module]) -> list[_BatchNorm]:
    return [
        m for layer in modules for m in layer.modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]


def has_training_batchnorm(modules: list[nn.Module]) -> bool:
    """Whether any BatchNorm in ``modules`` is in training mode (statistics per micro-batch)."""
    return any(m.training for layer in modules for m in layer.modules() if isinstance(m, _BatchNorm))


class DeferredBatchNorm:
    """Hooks on every tracked BatchNorm in ``modules`` that, while :attr:`chunks` > 1 in training,
    set the running statistics from the whole batch after the last micro-batch."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.chunks = 1
        self._state: dict[int, dict[str, Any]] = {}
        self._handles = []
        for bn in _tracked_batchnorms(modules):
            self._handles.append(bn.register_forward_pre_hook(self._before))
            self._handles.append(bn.register_forward_hook(self._after))

    def start(self, chunks: int) -> None:
        """A new forward over ``chunks`` micro-batches begins."""
        self.chunks = chunks
        self._state.clear()

    def _active(self, bn: _BatchNorm) -> bool:
        return self.chunks > 1 and bn.training

    def _before(self, bn: _BatchNorm, args: tuple[Any, ...]) -> None:
        if not self._active(bn):
            return
        x = args[0].detach()
        dims = [d for d in range(x.dim()) if d != 1]
        state = self._state.get(id(bn))
        if state is None:
            state = self._state[id(bn)] = {
                "mean": bn.running_mean.detach().clone(), "var": bn.running_var.detach().clone(),
                "tracked": bn.num_batches_tracked.detach().clone(),
                "sum": 0, "sumsq": 0, "count": 0, "seen": 0,
            }
        # float64 sums: the whole-batch variance from sums of squares without cancellation
        x64 = x.to(torch.float64)
        state["sum"] = state["sum"] + x64.sum(dims)
        state["sumsq"] = state["sumsq"] + (x64 * x64).sum(dims)
        state["count"] += x.numel() // x.size(1)

    @torch.no_grad()
    def _after(self, bn: _BatchNorm, args: tuple[Any, ...], output: Any) -> None:
        if not self._active(bn):
            return
        state = self._state[id(bn)]
        state["seen"] += 1
        if state["seen"] < self.chunks:
            return
        n = state["count"]
        mean = state["sum"] / n
        var = (state["sumsq"] - n * mean * mean) / max(n - 1, 1)  # unbiased, as BatchNorm keeps
        tracked = state["tracked"] + 1
        factor = bn.momentum if bn.momentum is not None else 1.0 / float(tracked)
        bn.running_mean.copy_((1 - factor) * state["mean"] + factor * mean.to(bn.running_mean.dtype))
        bn.running_var.copy_((1 - factor) * state["var"] + factor * var.to(bn.running_var.dtype))
        bn.num_batches_tracked.copy_(tracked)
        del self._state[id(bn)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
