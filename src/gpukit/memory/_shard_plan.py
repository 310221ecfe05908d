"""Per-rank memory of a training step under FSDP, from the single-device plan.

FSDP over ``world_size`` ranks keeps 1/world_size of every parameter, gradient and optimizer
state tensor on each rank (dim 0 padded to a multiple of world_size). On top it holds, at its
peak, the full parameters of the unit running and of the unit prefetched next (in the dtype
FSDP gathers in: the autocast dtype of "-mixed" precisions) and the unit's unsharded gradient
before the reduce-scatter. Activations, inputs and buffers are unchanged: each rank still runs
its own batch through the whole model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from gpukit.errors import ConfigurationError
from gpukit.memory._blocks import unit_param_counts, units_to_shard
from gpukit.memory._planner import MemoryEstimate
from gpukit.precision import fsdp_own_unit_layers

__all__ = ["shard_estimate", "fsdp_unit_numels"]


def fsdp_unit_numels(model: torch.nn.Module, precision: str) -> list[int]:
    """Parameters of each unit the Session's FSDP makes of ``model`` under ``precision`` (the
    default wrapping policy, the precision's own-unit layers, the root's remainder last): what
    :func:`shard_estimate` takes."""
    return unit_param_counts(model, units_to_shard(model, always=fsdp_own_unit_layers(precision)))


def shard_estimate(estimate: MemoryEstimate, world_size: int, unit_numels: Sequence[int]) -> MemoryEstimate:
    """``estimate`` (one device) as it would be per rank under FSDP over ``world_size`` ranks.

    Args:
        estimate: :func:`~gpukit.memory.estimate_memory`'s plan for one device.
        world_size: processes sharing the model.
        unit_numels: parameters of each FSDP unit (the root's remainder included); see
            ``gpukit.strategies.FSDPStrategy`` for which modules are units.

    Returns:
        A :class:`MemoryEstimate` whose parameter, gradient and optimizer figures are per rank.

    Raises:
        ConfigurationError: ``world_size`` below 1 or no units.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r}; use an int >= 1.")
    total = sum(unit_numels)
    if total <= 0:
        raise ConfigurationError("unit_numels is empty or holds no parameters; give each unit's parameter count.")
    shard = lambda nbytes: math.ceil(nbytes / world_size)  # noqa: E731
    params, grads, state = (shard(estimate.parameters_bytes), shard(estimate.gradients_bytes),
                            shard(estimate.optimizer_state_bytes))
    param_elem = estimate.parameters_bytes / total
    gathered_elem = 2 if estimate.precision.endswith("-mixed") else param_elem
    largest = max(unit_numels)
    unit_bytes = int(largest * (2 * gathered_elem + estimate.gradients_bytes / total)) if world_size > 1 else 0
    saved = (estimate.parameters_bytes - params) + (estimate.gradients_bytes - grads) + (
        estimate.optimizer_state_bytes - state)
    notes = (*estimate.notes,
             f"fsdp over {world_size} ranks: parameters, gradients and optimizer state per rank (1/{world_size}); "
             f"peak adds the largest unit ({largest:,} parameters) gathered twice and its unsharded gradient")
    return dataclasses.replace(
        estimate, peak_bytes=estimate.peak_bytes - saved + unit_bytes, parameters_bytes=params,
        gradients_bytes=grads, optimizer_state_bytes=state, notes=notes)
