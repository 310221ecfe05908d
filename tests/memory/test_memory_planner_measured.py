"""The planner against real allocations on the CPU (torch's profiler over the CPU allocator):
activation checkpointing lowers measured activations as much as the plan says, "-true"
precisions' fp32 norm layers are planned, and the peak is within 15%."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from gpukit.memory import estimate_memory, measure_step_memory

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import Transformer, mlp  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_checkpointing_saves_what_the_plan_says(precision: str) -> None:
    torch.manual_seed(0)
    model, tokens = Transformer(vocab=200, width=64, depth=3), torch.randint(0, 200, (8, 32))
    plans, measured = {}, {}
    for policy in (None, True):
        plans[policy] = estimate_memory(model, "adam", tokens, precision=precision, device="cpu",
                                        activation_checkpointing=policy)
        measured[policy] = measure_step_memory(copy.deepcopy(model), tokens, precision=precision,
                                               activation_checkpointing=policy)
        assert plans[policy].peak_bytes == pytest.approx(measured[policy].peak_bytes, rel=0.15)
    planned_saving = plans[None].activations_bytes - plans[True].activations_bytes
    measured_saving = measured[None].activations_bytes - measured[True].activations_bytes
    assert planned_saving > 0.3 * plans[None].activations_bytes  # checkpointing matters here
    assert planned_saving == pytest.approx(measured_saving, rel=0.15)
    assert plans[True].flops > plans[None].flops  # the recompute is counted
    assert plans[True].activation_checkpointing == "full" and "recomputed" in str(plans[True])


def test_measured_categories_match_the_plan() -> None:
    model, x = mlp(width=64, depth=2), torch.randn(32, 64)
    plan = estimate_memory(model, "adam", x, device="cpu")
    real = measure_step_memory(copy.deepcopy(model), x)
    assert real.gradients_bytes == plan.gradients_bytes and real.optimizer_state_bytes == pytest.approx(
        plan.optimizer_state_bytes, rel=0.01)
    assert real.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.05)
