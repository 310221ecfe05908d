"""How many consecutive layers each stage gets.

Given a ``balance`` it is checked; otherwise each layer's training memory is asked of gpukit's
memory planner (:func:`gpukit.memory.estimate_memory`, on fake tensors: nothing is allocated)
and the layers are cut into contiguous stages so that the largest stage is as small as
possible. Without an example input the planner cannot size activations, so layers are then
weighed by their parameter and buffer bytes only (and the placement says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["LayerCost", "layer_costs", "check_balance", "partition"]


@dataclass(frozen=True)
class LayerCost:
    """Memory one layer needs for training, in bytes (``None``: not planned)."""

    parameters_bytes: int
    planned_bytes: int | None

    @property
    def weight(self) -> int:
        return self.planned_bytes if self.planned_bytes is not None else self.parameters_bytes


def _state_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def layer_costs(
    modules: Sequence[nn.Module],
    example_input: Any,
    *,
    optimizer: Any,
    precision: str,
    device: torch.device | str,
) -> list[LayerCost]:
    """Per-layer memory: parameters+buffers always; with ``example_input`` also the planner's
    gradients, optimizer state and activations for that layer's input (shapes are carried
    from layer to layer on fake tensors).

    Raises:
        MemoryPlanError: a layer cannot run on fake tensors (pass ``balance=`` instead).
    """
    if example_input is None:
        return [LayerCost(_state_bytes(m), None) for m in modules]
    from gpukit.memory import estimate_memory

    planned_device = torch.device(device).type  # the planner's block rounding is per type
    costs: list[LayerCost] = []
    x = _as_meta(example_input)
    for module in modules:
        estimate = estimate_memory(module, optimizer, (x,), precision=precision, device=planned_device)
        planned = (
            estimate.parameters_bytes + estimate.buffers_bytes + estimate.gradients_bytes
            + estimate.optimizer_state_bytes + estimate.activations_bytes
        )
        costs.append(LayerCost(_state_bytes(module), planned))
        x = _as_meta(_output_shapes(module, x), requires_grad=True)
    return costs


def _as_meta(obj: Any, requires_grad: bool = False) -> Any:
    """Shapes and dtypes only: ``meta`` tensors in the same nesting (floating ones requiring
    grad past the first layer, as activations do in training)."""
    from torch.utils._pytree import tree_map

    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(requires_grad and t.is_floating_point())

    return tree_map(meta, obj)


def _output_shapes(module: nn.Module, x: Any) -> Any:
    """``module(x)`` on fake copies of its state (the real module is untouched), as meta."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from gpukit.errors import MemoryPlanError

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            # created under the mode, torch.empty gives a fake tensor: shape and dtype only
            fake = lambda t: torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t  # noqa: E731
            state = {k: fake(v) for k, v in [*module.named_parameters(), *module.named_buffers()]}
            with torch.no_grad():
                out = torch.func.functional_call(module, state, (tree_map(fake, x),))
            return out
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise MemoryPlanError(
            f"split(): could not carry the example input through {type(module).__name__} on fake "
            f"tensors to plan memory ({type(exc).__name__}: {exc}). Pass balance=[...] instead."
        ) from exc


def check_balance(balance: Any, stages: int, layers: int) -> list[int]:
    """``balance`` as a list of layer counts, one per stage, summing to ``layers``.

    Raises:
        ConfigurationError: not a list of ints >= 1, wrong length, or a wrong sum.
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in balance
    ):
        raise ConfigurationError(
            f"split(balance={balance!r}) needs a list of layer counts, one per device, e.g. "
            f"balance={[layers // stages] * (stages - 1) + [layers - layers // stages * (stages - 1)]}."
        )
    counts = list(balance)
    if len(counts) != stages:
        raise ConfigurationError(
            f"split(balance={counts}) gives {len(counts)} stage(s) but {stages} device(s) were "
            "given; give one layer count per device."
        )
    if any(n < 1 for n in counts):
        raise ConfigurationError(
            f"split(balance={counts}): every stage needs at least one layer; use counts >= 1."
        )
    if sum(counts) != layers:
        raise ConfigurationError(
            f"split(balance={counts}) sums to {sum(counts)}, but the model has {layers} layers; "
            f"the counts must add up to {layers} (every layer on exactly one device)."
        )
    return counts


def partition(weights: Sequence[int], stages: int) -> list[int]:
    """Layer counts of the contiguous split of ``weights`` into ``stages`` non-empty parts
    whose largest sum is smallest (ties: the earlier cut, which keeps later stages lighter,
    as the last stage also holds the output)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: smallest possible maximum when the first i layers form s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    counts: list[int] = []
    i = n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]
