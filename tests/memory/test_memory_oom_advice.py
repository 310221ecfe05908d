"""Out-of-memory messages name concrete fixes with the planner's predicted saving."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import gpukit
from gpukit.memory import StepOutOfMemoryError
from gpukit.memory._advice import planned_fixes

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import MlpBlock  # noqa: E402


class Boom(nn.Module):
    """Raises the out-of-memory error on real tensors (the planner's fake ones pass)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):
            raise torch.OutOfMemoryError("CPU out of memory (injected)")
        return x


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Sequential(*[MlpBlock(64) for _ in range(3)]), Boom(), nn.Linear(64, 1))


def test_oom_raise_names_options_with_planned_savings() -> None:
    session = gpukit.Session("cpu", precision="32-true", oom="raise", verbose=False)
    plain = _model()
    model, optimizer = session.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    batch = (torch.randn(64, 8), torch.randn(64, 1))
    with pytest.raises(StepOutOfMemoryError) as caught:
        session.run_step(lambda b: nn.functional.mse_loss(model(b[0]), b[1]), batch)
    message = str(caught.value)
    assert "Fixes, planned for this model and batch" in message
    for option in ("Session(activation_checkpointing=True): saves", "Session(precision='bf16-mixed'): saves",
                   "a batch of 32"):
        assert option in message
    assert "or lower the batch size, use" not in message  # the generic list is replaced


def test_planned_fixes_skips_what_is_on_and_what_cannot_be_planned() -> None:
    model = _model()
    text = planned_fixes(model, torch.randn(16, 8), precision="bf16-mixed", activation_checkpointing=True, device="cpu")
    assert text is not None and "activation_checkpointing" not in text and "precision=" not in text
    assert "a batch of 8" in text
    assert planned_fixes(model, torch.randn(16, 3), precision="32-true", device="cpu") is None  # wrong shape
