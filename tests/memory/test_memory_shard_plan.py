"""Per-rank planned memory under FSDP (gpukit.memory.shard_estimate, gpukit plan --strategy fsdp)."""

from __future__ import annotations

import pytest
from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.memory import estimate_memory, shard_estimate
from gpukit.memory import unit_param_counts, units_to_shard


def _model() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 4,
                                 enable_nested_tensor=False)


def test_state_shrinks_by_world_size_and_peak_adds_one_gathered_unit() -> None:
    import torch

    model = _model()
    units = unit_param_counts(model, units_to_shard(model))
    assert len(units) == 5 and units[-1] == 0  # four layers; nothing left for the root
    assert sum(units) == sum(p.numel() for p in model.parameters())
    one = estimate_memory(model, "adam", torch.empty(2, 8, 32), device="cpu")
    four = shard_estimate(one, 4, units)
    assert four.parameters_bytes == -(-one.parameters_bytes // 4)
    assert four.optimizer_state_bytes == -(-one.optimizer_state_bytes // 4)
    state = lambda e: e.parameters_bytes + e.gradients_bytes + e.optimizer_state_bytes  # noqa: E731
    unit_bytes = max(units) * 4 * 3  # fp32: gathered twice + its unsharded gradient
    assert four.peak_bytes == one.peak_bytes - (state(one) - state(four)) + unit_bytes
    assert shard_estimate(one, 1, units).peak_bytes == one.peak_bytes
    with pytest.raises(ConfigurationError, match="world_size=0"):
        shard_estimate(one, 0, units)
