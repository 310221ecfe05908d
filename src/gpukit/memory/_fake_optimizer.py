"""The optimizer in the planner's simulated step: which one, on fake parameters, and its state.

``estimate_memory`` runs the real optimizer's ``step`` on fake tensors. Some variants read a
value there (Adam's step counter via ``.item()``) and cannot run; :func:`make_optimizer` finds
one that can (``capturable``, then also ``foreach=False``) by a probe step -- once per process
for an optimizer, its settings and the tensors' kind, since the answer does not depend on the
model -- and :data:`STATE_PER_PARAM` stands in for the state of one that never can.

The variant matters for the peak: on CUDA torch's optimizers default to their *foreach*
implementation, which works on whole lists of tensors and so holds temporaries the size of all
parameters at once (Adam's ``sqrt`` of its second moment), where the per-tensor loop holds one
parameter's worth. The simulation runs on fake CPU tensors, where torch would pick the loop, so
:func:`as_on_device` asks for foreach where the planned device would get it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from gpukit.errors import ConfigurationError

__all__ = ["OPTIMIZERS", "STATE_PER_PARAM", "as_on_device", "make_optimizer", "optimizer_class", "state_bytes"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer] | None] = {
    "none": None,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
# state tensors per parameter, for optimizers whose step cannot run on fake tensors
STATE_PER_PARAM = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "Adadelta": 2, "RMSprop": 2}


def optimizer_class(optimizer: Any) -> tuple[type[torch.optim.Optimizer] | None, dict[str, Any]]:
    if optimizer is None:
        return None, {}
    if isinstance(optimizer, torch.optim.Optimizer):
        # defaults can hold derived keys the constructor rejects (AdamW: decoupled_weight_decay)
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        return type(optimizer), defaults
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, {}
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZERS:
        return OPTIMIZERS[optimizer.lower()], {}
    raise ConfigurationError(
        f"estimate_memory(optimizer={optimizer!r}): expected None, an optimizer instance or class, "
        f"or one of {', '.join(map(repr, OPTIMIZERS))}."
    )


#: device types on which torch's optimizers default to foreach (``torch.optim.Optimizer``'s
#: ``_default_to_fused_or_foreach``: CUDA among the plannable ones; not CPU, not MPS)
_FOREACH_BY_DEFAULT = ("cuda",)


def as_on_device(opt_cls: type[torch.optim.Optimizer] | None, defaults: dict[str, Any],
                 device_type: str) -> dict[str, Any]:
    """``defaults`` with the implementation torch picks on ``device_type`` made explicit, so the
    step simulated on fake CPU tensors is the one that runs there: ``foreach=True`` for CUDA,
    unless the optimizer was told (``foreach``/``fused`` set) or cannot (no ``foreach``
    argument, ``differentiable``)."""
    if opt_cls is None or device_type not in _FOREACH_BY_DEFAULT:
        return defaults
    if defaults.get("foreach") is not None or defaults.get("fused") or defaults.get("differentiable"):
        return defaults
    if "foreach" not in inspect.signature(opt_cls.__init__).parameters:
        return defaults
    return {**defaults, "foreach": True}


def make_optimizer(
    opt_cls: type[torch.optim.Optimizer] | None, defaults: dict[str, Any], params: list[torch.Tensor], notes: list[str]
) -> torch.optim.Optimizer | None:
    """The optimizer on fake parameters, in a variant whose step never reads a value
    (``capturable`` keeps Adam's step counter on the device instead of calling ``.item()``)."""
    if opt_cls is None or not params:
        return None
    # which variant runs is a property of the optimizer, its settings and the tensors' kind, not
    # of the model: probed once per process (a probe step is a third of a plan's optimizer time)
    key = (opt_cls, repr(sorted(defaults.items())), params[0].device.type,
           tuple(sorted({str(p.dtype) for p in params})))
    variants = _OPTIMIZER_VARIANTS
    if key in _WORKING_VARIANT:
        index = _WORKING_VARIANT[key]
        if index is None:
            notes.append(f"{opt_cls.__name__}.step could not run on fake tensors")
            return None
        return opt_cls(params, **{**defaults, **variants[index]})
    for index, extra in enumerate(variants):
        try:
            optimizer = opt_cls(params, **{**defaults, **extra})
            for p in params:  # probe one step on fake gradients, then discard its state
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
            _WORKING_VARIANT[key] = index
            return opt_cls(params, **{**defaults, **extra})
        except Exception:  # noqa: BLE001 - any failure means "this variant cannot run on fake tensors"
            for p in params:
                p.grad = None
            continue
    _WORKING_VARIANT[key] = None
    notes.append(f"{opt_cls.__name__}.step could not run on fake tensors")
    return None


_OPTIMIZER_VARIANTS: tuple[dict[str, Any], ...] = ({}, {"capturable": True}, {"capturable": True, "foreach": False})
_WORKING_VARIANT: dict[tuple[Any, ...], int | None] = {}  # see make_optimizer


def state_bytes(optimizer: torch.optim.Optimizer, tracker: Any) -> int:
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value.untyped_storage()) not in seen:
                seen.add(id(value.untyped_storage()))
                total += tracker.size(value.untyped_storage())
    return total
