"""Balancing stages: the contiguous partition, and weights from the memory planner."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.memory import estimate_memory
from gpukit.parallel import partition, split
from gpukit.parallel._balance import layer_costs


@pytest.mark.parametrize(
    ("weights", "stages", "counts"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 10], 2, [3, 1]),
        ([10, 1, 1, 1], 2, [1, 3]),
        ([1, 9, 1, 1, 9, 1], 3, [2, 2, 2]),
        ([5, 5, 5], 3, [1, 1, 1]),
    ],
)
def test_partition_minimises_the_largest_stage(weights: list[int], stages: int, counts: list[int]) -> None:
    assert partition(weights, stages) == counts


def test_planned_balance_isolates_the_heavy_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    example = torch.randn(32, 8)
    split_model = split(model, ["cpu"] * 3, example_input=example, verbose=False)
    assert [len(s.names) for s in split_model.stages] == [2, 1, 2]


def test_layer_costs_come_from_the_planner() -> None:
    first, middle = nn.Linear(8, 16), nn.Linear(16, 4)
    x = torch.randn(32, 8)
    costs = layer_costs([first, middle], x, optimizer="adam", precision="32-true", device="cpu")
    plan = estimate_memory(middle, "adam", (torch.randn(32, 16, requires_grad=True),), precision="32-true", device="cpu")
    assert costs[1].planned_bytes == (plan.parameters_bytes + plan.buffers_bytes + plan.gradients_bytes
                                      + plan.optimizer_state_bytes + plan.activations_bytes)
    assert costs[1].parameters_bytes == (16 * 4 + 4) * 4
    # no example input: parameter bytes only
    assert [c.planned_bytes for c in layer_costs([first], None, optimizer="adam", precision="32-true", device="cpu")] == [None]
