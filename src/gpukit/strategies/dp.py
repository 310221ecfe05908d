"""DataParallel: one process drives several GPUs, splitting each batch across them.

The model is always placed on ``device_ids[0]`` (the "main GPU") before wrapping, so torch's
"module must have its parameters and buffers on device cuda:1 (device_ids[0])" cannot happen.
Outputs are gathered on the main GPU, which therefore holds more memory than the others; to
even that out, compute the loss inside forward with :class:`ModelWithLoss` so that only one
number per GPU is gathered.

Prefer DDP (``strategy="ddp"``) for speed: DataParallel replicates the model every step and is
limited by Python's GIL. It is here because many existing scripts use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import parallel_apply

from gpukit.accelerators import Accelerator
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.placement import unwrap_model
from gpukit.strategies.base import Strategy

__all__ = ["DataParallelStrategy", "ModelWithLoss"]


class DataParallelStrategy(Strategy):
    """Wrap the model in :class:`torch.nn.DataParallel` over ``devices`` (first is main)."""

    name = "dp"

    def __init__(self, accelerator: Accelerator, devices: Sequence[torch.device]) -> None:
        super().__init__(accelerator, devices[0])
        self.devices = list(devices)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.checkpoint_activations(unwrap_model(module)).to(self.root_device)
        device_ids = [d.index for d in self.devices if d.index is not None]
        if not device_ids:
            # the CPU (or MPS): nothing to split, and DataParallel(device_ids=None) would grab
            # every GPU of the machine; the model runs as is, as DataParallel does without GPUs
            return module
        wrapped = _AutocastDataParallel(
            module, device_ids=device_ids, output_device=self.root_device.index
        )
        wrapped.gpukit_autocast = (self.root_device.type, self.precision.autocast_dtype)
        return wrapped

    @property
    def layout(self) -> Layout:
        return Layout(replicas=len(self.devices), one_process=True)

    def compile_targets(self, module: nn.Module) -> list[nn.Module]:
        if isinstance(module, nn.DataParallel):
            raise ConfigurationError(
                "torch.compile does not work with DataParallel (its replicas are copied each step); use "
                "strategy='ddp' (one process per GPU), which compiles, or compile=False.")
        return [module]

    def describe(self) -> str:
        shown = ", ".join(str(d) for d in self.devices)
        return f"dp over [{shown}], main {self.root_device}"


class _AutocastDataParallel(nn.DataParallel):
    """DataParallel that keeps the session's autocast dtype inside its replica threads.

    torch re-enters autocast in each replica thread with the *default* dtype (fp16 on CUDA),
    so bf16-mixed would silently become fp16 there; each replica call re-enters it with ours.
    """

    gpukit_autocast: tuple[str, torch.dtype | None] = ("cpu", None)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Any, kwargs: Any) -> list:
        device_type, dtype = self.gpukit_autocast
        if dtype is None or not torch.is_autocast_enabled(device_type):
            return super().parallel_apply(replicas, inputs, kwargs)
        calls = [_AutocastCall(r, device_type, dtype) for r in replicas]
        return parallel_apply(calls, inputs, kwargs, self.device_ids[: len(replicas)])


class _AutocastCall:
    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Any:  # parallel_apply may inspect it
        return self.module.parameters(recurse)


class ModelWithLoss(nn.Module):
    """``model`` followed by ``loss_fn``, so DataParallel gathers losses, not outputs.

    ``forward(*inputs, target)`` returns the loss as a 1-element tensor per replica; under
    DataParallel you get one loss per GPU, so call ``.mean()`` before ``backward``.

    Args:
        model: the network.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: Any, target: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*inputs), target).reshape(1)
