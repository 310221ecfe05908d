"""The precisions (:class:`Precision`, :class:`MixedPrecision`, :class:`TruePrecision`), the layers the
"-true" ones keep in fp32, and :func:`get_precision`, which turns a name into one."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Any

import torch
from torch import nn

from gpukit._util.precision_names import precision_name
from gpukit.accelerators import Accelerator
from gpukit.errors import ConfigurationError
from gpukit.precision._autocast import AutocastForward
from gpukit.precision._casting import cast_inputs_hook, cast_outputs_hook

__all__ = ["MixedPrecision", "NORM_LAYERS", "Precision", "STATS_NORM_LAYERS", "TruePrecision",
           "add_true_precision_casts", "fsdp_own_unit_layers", "get_precision"]



#: the methods a "-mixed" precision runs under autocast: the forward, and a Hugging Face model's
#: ``generate`` (an encoder-decoder's runs its encoder outside the forward)
AUTOCAST_METHODS = ("forward", "generate")

#: layers kept in fp32 by the "-true" precisions: their statistics lose too much in 16 bits
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    cls
    for cls in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
    )
    if cls is not None
)

#: norm layers with running statistics (fp32 buffers, which ``batch_norm`` wants in its weights' dtype)
STATS_NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase,)


def fsdp_own_unit_layers(name: str) -> tuple[type[nn.Module], ...]:
    """Layers FSDP makes units of their own under precision ``name``, so that one unit holds one
    dtype: a "-true" precision's fp32 norm layers; under a "-mixed" one the layers with running
    statistics (their fp32 buffers are not FSDP's to cast, so their weights are gathered in fp32
    too). The Session's FSDP and the planner's FSDP estimates both use it."""
    if name.endswith("-mixed"):
        return STATS_NORM_LAYERS
    return NORM_LAYERS if name.endswith("-true") and name != "32-true" else ()


class Precision:
    """Base class: full fp32, nothing to do. Subclasses override only what differs."""

    name: str = "32-true"
    #: dtype that autocast runs matmuls in, or ``None`` without autocast
    autocast_dtype: torch.dtype | None = None
    #: dtype the weights are stored in
    param_dtype: torch.dtype = torch.float32

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of fp16 mixed precision; ``None`` otherwise."""
        return None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the weights to this precision's storage dtype (in place).

        Raises:
            ConfigurationError: ``module`` was converted by another "-true" precision before.
        """
        check_not_converted(module, self.name)
        return module

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A context in which forward passes run at this precision."""
        return contextlib.nullcontext()

    def wrap_forward(self, module: nn.Module) -> nn.Module:
        """Make ``module``'s own forward run at this precision (in place): here, take off the autocast
        forward (and ``generate``) of an earlier set-up at a "-mixed" precision, if any; returns ``module``."""
        for method in AUTOCAST_METHODS:
            present = vars(module).get(method)
            if isinstance(present, AutocastForward):
                if present.inner is None:
                    delattr(module, method)
                else:
                    setattr(module, method, present.inner)
        return module

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on."""
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size before clipping (scaler only)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer. Returns False when the step was skipped (non-finite grads)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class MixedPrecision(Precision):
    """Weights in fp32, forward under ``torch.autocast``; fp16 adds a GradScaler."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(device)
        self.name = name
        self.autocast_dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16
        self._scaler = (
            torch.amp.GradScaler(device.type) if self.autocast_dtype == torch.float16 else None
        )
        # whether scale_loss() ran since the last optimizer step: a plain loss.backward()
        # leaves the gradients unscaled, and GradScaler then fails deep inside torch
        self._scaled_since_step = False
        self._watched: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers with our step hook
        self._stepped = False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self._scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def wrap_forward(self, module: nn.Module) -> nn.Module:
        """Run ``module``'s forward (and a Hugging Face model's ``generate``) under this precision's
        autocast, its 16-bit floating outputs returned in fp32 (see :class:`AutocastForward`); in place,
        the module and its keys unchanged.

        Args:
            module: the module whose calls should run mixed (the strategy names which one).

        Returns:
            ``module``.
        """
        dtype = self.autocast_dtype
        assert dtype is not None  # a MixedPrecision always has one
        for method in AUTOCAST_METHODS:
            if method != "forward" and not inspect.isfunction(getattr(type(module), method, None)):
                continue  # no generate (not a Hugging Face model)
            present = vars(module).get(method)
            if isinstance(present, AutocastForward):  # set up again: replace, never stack
                present = present.inner
            # nn.Module.__setattr__ keeps a non-module value in the instance dict, which shadows the
            # class's forward for nn.Module.__call__ (and for torch.compile, which traces the same call)
            setattr(module, method, AutocastForward(module, present, self.device.type, dtype, method))
        return module

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self._scaler is None:
            return loss
        self._scaled_since_step = True
        return self._scaler.scale(loss)

    def _check_scaled(self) -> None:
        if not self._scaled_since_step:
            raise ConfigurationError(
                "Precision '16-mixed' scales the loss before backward, but no scaled loss "
                "was seen since the last optimizer step: the gradients came from a plain "
                "loss.backward(). Call session.backward(loss) instead of loss.backward() "
                "(or use precision='bf16-mixed' or '32-true', which need no loss scaling)."
            )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler is not None:
            self._check_scaled()
            self._scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._scaler is None:
            optimizer.step()
            return True
        self._check_scaled()
        self._scaled_since_step = False
        if not hasattr(optimizer, "register_step_post_hook") or getattr(optimizer, "_step_supports_amp_scaling", False):
            # not a torch.optim.Optimizer, or one that skips an inf step inside its own kernel (fused=True
            # given to Adam/AdamW/SGD): GradScaler calls its step() then too, so the step hook cannot tell
            scale_before = self._scaler.get_scale()  # .item(): a device sync, before and after
            self._scaler.step(optimizer)
            self._scaler.update()
            # update() lowers the scale exactly when this step found non-finite gradients
            return self._scaler.get_scale() >= scale_before
        if optimizer not in self._watched:  # told when the optimizer really steps: no extra sync
            optimizer.register_step_post_hook(self._stepped_hook)
            self._watched.add(optimizer)
        self._stepped = False
        self._scaler.step(optimizer)  # skips optimizer.step() when a gradient is inf/nan
        self._scaler.update()
        return self._stepped

    def _stepped_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def __getstate__(self) -> dict[str, Any]:
        # Session(precision=MixedPrecision(...)).launch(fn) pickles it to the workers: a WeakSet does not
        # pickle, and the optimizers it names (with this object's step hook) stay in this process
        state = dict(self.__dict__)
        state["_watched"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watched = weakref.WeakSet()

    def state_dict(self) -> dict[str, Any]:
        return {} if self._scaler is None else {"scaler": self._scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])


class TruePrecision(Precision):
    """Weights and maths in bf16 or fp16; normalisation layers stay fp32.

    Floating-point inputs are cast to the low dtype on the way into the model and its
    floating-point outputs back to fp32, so the loss is computed in fp32.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(device)
        self.name = name
        self.param_dtype = torch.bfloat16 if name.startswith("bf16") else torch.float16

    def convert_module(self, module: nn.Module) -> nn.Module:
        if getattr(module, "_gpukit_precision", None) == self.name:
            return module  # set up twice (e.g. re-wrapped): hooks must not stack
        check_not_converted(module, self.name)
        module.to(self.param_dtype)
        for sub in module.modules():
            if isinstance(sub, NORM_LAYERS):
                sub.float()
        add_true_precision_casts(module, self.param_dtype)
        module._gpukit_precision = self.name
        return module


def check_not_converted(module: nn.Module, name: str) -> None:
    """Refuse to set up at precision ``name`` a model a "-true" precision converted before (its weights
    were cast to 16 bits in place, with casting hooks): it would train those 16-bit weights, stacked
    hooks and all, while ``session.precision`` says ``name`` -- e.g. a notebook cell re-run with
    another precision on the model an earlier cell set up.

    Raises:
        ConfigurationError: ``module`` was converted at another precision.
    """
    done = getattr(module, "_gpukit_precision", None)
    if done is None or done == name:
        return
    low = "bf16" if done.startswith("bf16") else "fp16"
    raise ConfigurationError(
        f"This model was set up at precision {done!r} before, which converted its weights to {low} in "
        f"place; set up again at {name!r} it would still train those {low} weights. Build the "
        f"model again (or load its saved weights into a new one) and set that up at {name!r}, or keep {done!r}."
    )


def add_true_precision_casts(module: nn.Module, low: torch.dtype, *, cast_inputs: bool = True) -> list[Any]:
    """The casts a "-true" precision adds to ``module`` (:class:`TruePrecision`; the planner simulates the
    same, then removes them): its norm layers (:data:`NORM_LAYERS`, kept in fp32) take fp32 inputs and
    give ``low`` outputs, its floating outputs come back in the default dtype and, with ``cast_inputs``,
    its floating inputs go in as ``low``.

    Returns:
        The hooks' handles (``handle.remove()`` takes one off).
    """
    handles = []
    for sub in module.modules():
        if isinstance(sub, NORM_LAYERS):
            handles.append(sub.register_forward_pre_hook(cast_inputs_hook(torch.float32), with_kwargs=True))
            handles.append(sub.register_forward_hook(cast_outputs_hook(low)))
    if cast_inputs:
        handles.append(module.register_forward_pre_hook(cast_inputs_hook(low), with_kwargs=True))
    handles.append(module.register_forward_hook(cast_outputs_hook(torch.get_default_dtype())))
    return handles


def get_precision(
    name: str | Precision, accelerator: Accelerator, device: torch.device
) -> Precision:
    """The precision object for ``name`` on ``device``.

    Args:
        name: one of :data:`PRECISIONS`, or a ready :class:`Precision`. The aliases
            ``32``/``"fp32"``/``"float32"`` (32-true), ``16`` (16-mixed) and ``"bf16"``
            (bf16-mixed) are accepted; ``"fp16"``, ``"half"`` and the like are ambiguous
            and rejected with a suggestion.
        accelerator: the accelerator of ``device`` (asked what it supports).
        device: the device the model runs on.

    Raises:
        ConfigurationError: unknown name, or a precision the device cannot run.
    """
    if isinstance(name, Precision):
        return name
    key = precision_name(name)
    if key == "auto":
        key = accelerator.auto_precision(device)
    if key == "32-true":
        return Precision(device)
    if key.startswith("bf16") and not accelerator.supports_bf16(device):
        raise ConfigurationError(
            f"Precision {key!r} needs native bfloat16, which {device} does not have "
            "(CUDA needs compute capability 8.0+, i.e. Ampere or newer). Use '16-mixed' or "
            "'32-true'."
        )
    if key == "16-mixed" and not accelerator.supports_fp16_autocast():
        raise ConfigurationError(
            f"Precision '16-mixed' needs float16 autocast, which {device} does not support. "
            "Use '32-true' or 'bf16-mixed'."
        )
    if key.endswith("-mixed"):
        return MixedPrecision(key, device)
    return TruePrecision(key, device)
