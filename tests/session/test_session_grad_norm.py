"""``session.grad_norm`` (issue 28, item 2): the total gradient norm of each clipped step, for every
precision, equal to what plain torch's ``clip_grad_norm_`` returns (16-mixed: after unscaling);
inf/nan reported and the step skipped under 16-mixed, as GradScaler does. DDP and FSDP (the global
norm over the shards) are checked with 2 processes in test_session_two_ranks.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gpukit

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def _plain_norms(precision: str, accumulate: int, max_norm: float) -> list[float]:
    """The same loop in plain torch, the norm as ``clip_grad_norm_`` returns it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    low = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    if precision.endswith("-true") and precision != "32-true":
        model.to(low)
        model[1].float()  # the norm layer stays fp32, as gpukit keeps it
    norms = []
    for i, (x, y) in enumerate(_batches()):
        if precision.endswith("-mixed"):
            with torch.autocast("cpu", dtype=low):
                out = model(x)
        elif precision == "32-true":
            out = model(x)
        else:
            h = model[0](x.to(low)).float()
            out = model[3](model[2](model[1](h).to(low))).float()
        loss = nn.functional.mse_loss(out.float(), y) / accumulate
        (scaler.scale(loss) if scaler else loss).backward()
        if (i + 1) % accumulate == 0:
            if scaler:
                scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_grad_norm_equals_plain_torch(precision: str, accumulate: int) -> None:
    session = gpukit.Session(accelerator="cpu", precision=precision, accumulate_grad_batches=accumulate,
                             verbose=False)
    model = _model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert session.grad_norm is None
    norms = []
    for i, (x, y) in enumerate(_batches()):
        with session.accumulate(model), session.autocast():
            out = model(x)
        session.backward(nn.functional.mse_loss(out.float(), y))
        session.step(optimizer, clip_grad_norm=0.5)
        if (i + 1) % accumulate == 0:  # a boundary: stepped, or skipped by 16-mixed's scaler
            assert isinstance(session.grad_norm, torch.Tensor)
            norms.append(float(session.grad_norm))
    expected = _plain_norms(precision, accumulate, 0.5)
    assert len(norms) == len(expected) == 4 // accumulate
    finite = [n for n in expected if math.isfinite(n)]
    # 16-mixed: the first scale (65536) overflows fp16 once -- inf in both, that step skipped in both
    assert [math.isfinite(n) for n in norms] == [math.isfinite(n) for n in expected]
    assert [n for n in norms if math.isfinite(n)] == pytest.approx(finite, rel=1e-6 if precision == "32-true" else 1e-2)
    assert all(n > 0.5 for n in finite)  # the clip was active: the norm reported is before clipping


def test_infinite_norm_under_16_mixed_is_reported_and_the_step_skipped() -> None:
    session = gpukit.Session(accelerator="cpu", precision="16-mixed", verbose=False)
    model = _model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    with session.autocast():
        out = model(x)
    session.backward(nn.functional.mse_loss(out.float(), y) * float("inf"))
    assert session.step(optimizer, clip_grad_norm=1.0) is False  # skipped, as GradScaler skips it
    assert not math.isfinite(float(session.grad_norm))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert session.optimizer_steps == 0


def test_inf_clip_measures_without_clipping() -> None:
    session = gpukit.Session(accelerator="cpu", verbose=False)
    model = _model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    session.backward(nn.functional.mse_loss(model(x), y))
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    session.step(optimizer, clip_grad_norm=math.inf)
    assert float(session.grad_norm) == pytest.approx(float(expected), rel=1e-6)


def test_pipeline_over_two_cpu_stages_reports_the_whole_models_norm() -> None:
    session = gpukit.Session(strategy="pipeline", devices=["cpu", "cpu"], verbose=False)
    model = _model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    session.backward(nn.functional.mse_loss(model(x), y))
    session.step(optimizer, clip_grad_norm=0.5)
    assert float(session.grad_norm) == pytest.approx(_plain_norms("32-true", 1, 0.5)[0], rel=1e-6)
