"""AutocastForward: a "-mixed" model's forward that enters ``torch.autocast`` by itself."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit.precision._casting import _cast

__all__ = ["AutocastForward"]

#: the dtypes autocast computes in; a "-mixed" model's outputs in them come back in fp32
_LOW_DTYPES = (torch.bfloat16, torch.float16)


class AutocastForward:
    """A module's forward (or ``generate``) run under ``torch.autocast``, set as the module's own ``forward``.

    This is how the model returned by ``session.setup`` computes at a "-mixed" precision without
    ``with session.autocast():`` around its calls (as Accelerate's patched forward and Fabric's
    wrapped module do). Floating outputs in 16 bits come back in fp32 (the default dtype), as FSDP's
    root returns them and as autocast computes losses anyway: a loss taken outside autocast
    (``mse_loss(model(x), y)`` against an fp32 target) works and is computed in fp32.

    An object rather than a closure: it keeps a reference to its module, so ``copy.deepcopy`` of the
    model (an EMA copy) runs the copy's weights, and the model still pickles. It is no ``nn.Module``,
    so ``state_dict`` keys do not change. Inside an enclosing ``session.autocast()`` (same dtype) it
    enters nothing: ~1.5 us of Python per call (bench/autocast_forward.py, docs/sessions.md).

    The same object stands for a Hugging Face model's ``generate`` (``method="generate"``): an
    encoder-decoder's ``generate`` runs its encoder by itself (``get_encoder()(...)``), outside the
    model's forward, so the encoder computed in fp32 at a "-mixed" precision.

    Attributes:
        module: the module whose forward this is.
        inner: the instance ``forward`` it replaced, or ``None`` for the class's ``forward``.
        device_type, dtype: the autocast's.
        method: the name of the method it stands for: ``"forward"``, or ``"generate"``.
    """

    method = "forward"  # a class default: objects pickled before there was a choice load as forward

    def __init__(self, module: nn.Module, inner: Any, device_type: str, dtype: torch.dtype,
                 method: str = "forward") -> None:
        self.module = module
        self.inner = inner
        self.device_type = device_type
        self.dtype = dtype
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled(self.device_type) and torch.get_autocast_dtype(self.device_type) == self.dtype:
            output = self._forward(*args, **kwargs)  # inside session.autocast() already: nothing to enter
        else:
            with torch.autocast(self.device_type, dtype=self.dtype):
                output = self._forward(*args, **kwargs)
        return _cast(output, torch.get_default_dtype(), only=_LOW_DTYPES)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return getattr(type(self.module), self.method)(self.module, *args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        # inspect.signature(model.forward) follows this: the model's own arguments (Hugging Face
        # code reads them to pick the batch's columns)
        return self.inner if self.inner is not None else getattr(type(self.module), self.method).__get__(self.module)

    def __repr__(self) -> str:
        return f"AutocastForward({type(self.module).__name__}.{self.method}, {self.device_type}, {self.dtype})"
