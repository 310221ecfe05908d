"""``split(model, layers=[...])`` replaces ``model.forward`` by the chain of the layers: check
once that the two agree, so a custom forward (residual connections, extra ops) is never
silently dropped."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import ConfigurationError

__all__ = ["check_chain_matches_forward"]

_WARNED: set[type] = set()


def check_chain_matches_forward(model: nn.Module, modules: Sequence[nn.Module], example_input: Any) -> None:
    """Compare ``model(x)`` with ``modules[-1](...modules[0](x))`` on a random input shaped like
    ``example_input`` (eval mode, no grad, where the model is); warn once per class without one.

    Raises:
        ConfigurationError: the outputs differ (or differ in structure).
    """
    if example_input is None:
        if type(model) not in _WARNED:
            _WARNED.add(type(model))
            warn_at_user_code(UserWarning(
                f"split(layers=[...]) replaces {type(model).__name__}.forward by the chain of the named layers; "
                "anything else its forward does (residual connections, extra operations) is dropped. Pass "
                "example_input=... to have split check that both give the same output."))
        return
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        return  # nothing to compute with yet
    device = tensors[0].device if tensors else torch.device("cpu")
    x = tree_map(lambda t: _random_like(t, device) if isinstance(t, torch.Tensor) else t, example_input)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            expected = _run(model, x)
            chained = x
            for module in modules:
                chained = _run(module, chained)
    finally:
        for module, training in modes.items():
            module.training = training
    difference = _max_difference(expected, chained)
    if difference is not None and difference <= 1e-4:
        return
    what = "outputs of another structure" if difference is None else f"outputs that differ by up to {difference:.3g}"
    raise ConfigurationError(
        f"split(layers=[...]): chaining the named layers gives {what} than {type(model).__name__}.forward on "
        "example_input, so the split model would compute something else (a forward with residual connections "
        "or extra operations). Name layers whose chain is the model's forward (e.g. wrap each residual block "
        "into one module), or make the model an nn.Sequential.")


def _random_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point():
        return torch.randn(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)  # ids: 0 is always valid


def _run(module: nn.Module, x: Any) -> Any:
    if isinstance(x, dict):
        return module(**x)
    return module(*x) if isinstance(x, (tuple, list)) else module(x)


def _max_difference(a: Any, b: Any) -> float | None:
    left, right = tree_leaves(a), tree_leaves(b)
    if len(left) != len(right):
        return None
    worst = 0.0
    for x, y in zip(left, right):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.shape != y.shape:
            return None
        scale = max(1.0, float(x.abs().max())) if x.numel() else 1.0
        worst = max(worst, float((x.float() - y.float()).abs().max()) / scale if x.numel() else 0.0)
    return worst
