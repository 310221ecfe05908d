"""The split model: consecutive stages on their devices, run over micro-batches.

Forward with ``chunks=K`` (GPipe's fill-drain schedule): the batch is cut into K micro-batches
along dim 0; at clock tick ``k`` stage ``s`` runs micro-batch ``k - s``, so while stage 1 works
on micro-batch 0, stage 0 already works on micro-batch 1. The ticks are issued from this one
thread; on GPUs kernel launches are asynchronous and each device runs its own queue, so the
stages overlap in time (backward overlaps too: PyTorch's autograd engine runs one thread per
GPU). On the CPU, where the stages are all ``"cpu"``, the order is the same and the result
equal, but nothing runs concurrently: that is the test set-up, not a speed-up.

Autograd follows every ``.to(device)``: activations go forward to the next stage's device and
their gradients come back. The micro-batch outputs are concatenated on the last device, so a
loss over them is the loss over the whole batch, and its gradients equal the unsplit model's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpukit.accelerators import get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.parallel._batchnorm import DeferredBatchNorm
from gpukit.placement import to_device

__all__ = ["SplitModel", "Stage"]


class Stage:
    """One stage: consecutive layers (``first`` to ``first + len(names) - 1``) on ``device``."""

    def __init__(self, index: int, device: torch.device, first: int, names: list[str], modules: list[nn.Module]) -> None:
        self.index, self.device, self.first = index, device, first
        self.names, self.modules = names, modules
        self._accelerator = get_accelerator(device)

    def __call__(self, x: Any) -> Any:
        x = to_device(x, self.device)
        # the stage's device is current while its layers run (new tensors land there)
        with self._accelerator.device_scope(self.device):
            for module in self.modules:
                x = module(x)
        return x

    def __repr__(self) -> str:
        return f"Stage({self.index}, {self.device}, layers {self.first}..{self.first + len(self.names) - 1})"


class SplitModel(nn.Module):
    """A model whose layers run as consecutive stages on several devices (see :func:`split`).

    ``state_dict``/``load_state_dict`` use the plain model's keys: what a split model saves
    loads into the unsplit model and back. ``gpukit.unwrap_model`` returns the plain model.

    Attributes:
        module: the plain model (its layers now sit on the stages' devices).
        stages: the :class:`Stage` objects, in order.
        chunks: micro-batches per forward.
        output_device: where outputs are returned (the last stage's device).
    """

    #: gpukit.unwrap_model looks through wrappers that set this (see placement.py)
    gpukit_wraps_module = True

    def __init__(self, module: nn.Module, stages: list[Stage], chunks: int, deferred_batchnorm: bool) -> None:
        super().__init__()
        self.module = module
        self.stages = stages
        self.chunks = chunks
        self.output_device = stages[-1].device
        layers = [m for stage in stages for m in stage.modules]
        self._deferred_bn = DeferredBatchNorm(layers) if deferred_batchnorm else None

    @property
    def devices(self) -> list[torch.device]:
        """The device of each stage."""
        return [stage.device for stage in self.stages]

    def forward(self, x: Any) -> Any:
        """Run the layers in order over ``chunks`` micro-batches; the output is on the last device.

        Hooks on the plain model (e.g. the input/output casts of a "-true" precision) run around
        the whole pipeline, as they ran around the plain model's forward.

        Args:
            x: the first layer's input (a tensor, or a tuple/list/dict of them), on any device.

        Raises:
            ConfigurationError: the batch has fewer samples than ``chunks``.
        """
        # nn.Module.__call__ runs the model's hooks around self.forward: point that at the
        # pipeline for the length of this call (an instance attribute shadows the method)
        self.module.forward = self._pipeline
        try:
            return self.module(x)
        finally:
            del self.module.forward

    def _pipeline(self, x: Any) -> Any:
        if self.chunks == 1:
            out = x
            for stage in self.stages:
                out = stage(out)
            return out
        micro = scatter(x, self.chunks)
        if self._deferred_bn is not None:
            self._deferred_bn.start(len(micro))
        stages, k = self.stages, len(micro)
        for clock in range(k + len(stages) - 1):
            # stage s works on micro-batch clock - s: the fill-drain (GPipe) diagonal
            for s in range(max(0, clock - k + 1), min(len(stages), clock + 1)):
                micro[clock - s] = stages[s](micro[clock - s])
        return gather(micro)

    # -- the plain model's keys, not "module.<key>" ------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The plain model's state dict (its keys, tensors on their stages' devices)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a plain model's state dict; each tensor is copied to its stage's device."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def describe(self) -> str:
        """One line: the stages, their devices and the number of micro-batches."""
        stages = ", ".join(f"{s.device}[{s.first}..{s.first + len(s.names) - 1}]" for s in self.stages)
        return f"pipeline {stages}, chunks={self.chunks}"

    def extra_repr(self) -> str:
        return self.describe()


def _batch_size(leaves: Sequence[Any]) -> int | None:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.size(0))
    return None


def scatter(x: Any, chunks: int) -> list[Any]:
    """``x`` cut into ``chunks`` micro-batches along dim 0 (tensors whose dim 0 is the batch
    size are cut; other leaves are passed to every micro-batch as they are).

    Raises:
        ConfigurationError: no batched tensor in ``x``, or fewer samples than ``chunks``.
    """
    leaves, spec = tree_flatten(x)
    batch = _batch_size(leaves)
    if batch is None:
        raise ConfigurationError(
            f"split(chunks={chunks}) cuts the input along dim 0, but the input holds no tensor "
            "with a batch dimension; use chunks=1 or pass batched tensors."
        )
    if batch < chunks:
        raise ConfigurationError(
            f"split(chunks={chunks}) needs at least {chunks} samples per batch to make {chunks} "
            f"micro-batches, but this batch has {batch}. Use a batch of >= {chunks} samples (a "
            "last, smaller batch: drop_last=True in the loader) or fewer chunks."
        )
    pieces = [
        leaf.tensor_split(chunks) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.size(0) == batch
        else [leaf] * chunks
        for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(chunks)]


def gather(outputs: list[Any]) -> Any:
    """The micro-batch outputs concatenated along dim 0 (same nesting as each output).

    Raises:
        ConfigurationError: an output tensor has no batch dimension (e.g. a scalar loss
            computed inside the model), so micro-batches cannot be joined.
    """
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    joined = []
    for i, leaf in enumerate(flat[0][0]):
        if not isinstance(leaf, torch.Tensor):
            joined.append(leaf)
            continue
        if leaf.dim() == 0:
            raise ConfigurationError(
                "split(chunks>1): the last layer returned a 0-dim tensor, which cannot be joined "
                "across micro-batches; return per-sample outputs and compute the loss outside "
                "the model, or use chunks=1."
            )
        joined.append(torch.cat([leaves[i] for leaves, _ in flat], dim=0))
    return tree_unflatten(joined, spec)
