"""Out-of-memory messages name concrete fixes with the planner's predicted saving."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import gpukit
from gpukit._util.units import format_bytes
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory import OomBackoff, OutOfMemoryAfterBackoffError, StepOutOfMemoryError, estimate_memory, find_batch_size
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
    assert text is not None and "activation_checkpointing" not in text and "precision='bf16-mixed'" not in text
    assert "Session(precision='bf16-true')" in text  # a lower-memory precision than the one in use
    assert "a batch of 8" in text
    assert planned_fixes(model, torch.randn(16, 3), precision="32-true", device="cpu") is None  # wrong shape


def _saving(model: nn.Module, x: torch.Tensor, base: str = "32-true", **change: object) -> str:
    """The saving the planner itself predicts for ``change`` over ``base`` precision without
    checkpointing, formatted as the messages print it."""
    def peak(**settings: object) -> int:
        merged = {"precision": base, "activation_checkpointing": None, **settings}
        return estimate_memory(model, None, x, device="cpu", **merged).peak_bytes  # type: ignore[arg-type]

    return format_bytes(peak() - peak(**change))


def test_backoff_gives_up_and_backs_off_naming_planned_options(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()  # every real forward runs out of memory
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    backoff = OomBackoff(device="cpu", min_micro_batch_size=16, model=model, precision="32-true")
    with caplog.at_level(logging.WARNING, logger="gpukit.memory"), pytest.raises(OutOfMemoryAfterBackoffError) as caught:
        backoff.run(lambda part, weight: nn.functional.mse_loss(model(part[0]), part[1]) * weight, (x, y))
    message = str(caught.value)
    assert "Out of memory at micro-batch size 16" in message and "or more devices" not in message  # not generic
    assert f"Session(activation_checkpointing=True): saves {_saving(model, x[:16], activation_checkpointing=True)}" in message
    assert f"Session(precision='bf16-true') (bf16 weights, no fp32 master copy): saves " \
           f"{_saving(model, x[:16], precision='bf16-true')}" in message
    assert "a batch of" not in message  # halving is what just failed
    backoffs = [r.getMessage() for r in caplog.records if "retrying with micro-batch" in r.getMessage()]
    assert len(backoffs) == 2  # 64 -> 32 -> 16; only the first one plans
    assert f"Session(activation_checkpointing=True): saves {_saving(model, x, activation_checkpointing=True)}" in backoffs[0]
    assert "saves" not in backoffs[1]


def test_session_backoff_error_names_the_micro_batch_fixes_once() -> None:
    session = gpukit.Session("cpu", precision="bf16-mixed", oom="backoff", verbose=False)
    plain = _model()
    model, optimizer = session.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    with pytest.raises(OutOfMemoryAfterBackoffError) as caught:
        session.run_step(lambda b: nn.functional.mse_loss(model(b[0]).float(), b[1]), (x, torch.randn(4, 1)))
    message = str(caught.value)
    assert message.count("Fixes, planned for this model and batch") == 1  # once, for the micro-batch of 1
    assert f"Session(precision='bf16-true') (bf16 weights, no fp32 master copy): saves " \
           f"{_saving(plain, x[:1], base='bf16-mixed', precision='bf16-true')}" in message


def test_find_batch_size_gives_up_naming_planned_options() -> None:
    model = _model()
    with pytest.raises(MemoryPlanError) as caught:
        find_batch_size(lambda size: model(torch.randn(size, 8)), start=8, device="cpu", model=model,
                        example_input=torch.randn(2, 8))
    message = str(caught.value)
    assert "even the start size 8 runs out of memory" in message and "Try start=1" not in message
    x = torch.empty(8, 8)
    assert f"Session(activation_checkpointing=True): saves {_saving(model, x, activation_checkpointing=True)}" in message
    assert f"Session(precision='bf16-true') (bf16 weights, no fp32 master copy): saves " \
           f"{_saving(model, x, precision='bf16-true')}" in message
    assert _saving(model, x, precision="bf16-mixed").startswith("-")  # fp32 weights + bf16 copies: costs here
    assert "precision='bf16-mixed'" not in message  # so it is not offered
    assert "a batch of 4" in message
    with pytest.raises(ConfigurationError, match="give both"):
        find_batch_size(lambda size: None, device="cpu", model=model)
