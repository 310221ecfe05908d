"""``session.setup_scheduler`` (issue 28, item 4): one scheduler step per optimizer step -- not per
micro-batch, not for a step 16-mixed skipped -- saved and resumed with the session."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpukit
from gpukit.errors import ConfigurationError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _session_and_model(**options):
    session = gpukit.Session(accelerator="cpu", verbose=False, **options)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = session.setup(model, optimizer)
    return session, model, optimizer, session.setup_scheduler(scheduler)


def _micro_batch(session, model, optimizer, scheduler, scale: float = 1e-3) -> None:
    x = torch.ones(2, 4)
    with session.autocast():
        out = model(x)
    session.backward(out.float().pow(2).mean() * scale)
    session.step(optimizer)
    scheduler.step()  # once per batch, as a plain loop calls it


def test_one_scheduler_step_per_optimizer_step_under_accumulation() -> None:
    session, model, optimizer, scheduler = _session_and_model(accumulate_grad_batches=4)
    lrs = []
    for _ in range(12):
        _micro_batch(session, model, optimizer, scheduler)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert session.optimizer_steps == 3
    # plain torch: StepLR stepped after each of the 3 optimizer steps
    assert lrs == [0.1] * 3 + [0.05] * 4 + [0.025] * 4 + [0.0125]


def test_a_skipped_16_mixed_step_does_not_advance_the_schedule() -> None:
    session, model, optimizer, scheduler = _session_and_model(precision="16-mixed")
    _micro_batch(session, model, optimizer, scheduler)
    _micro_batch(session, model, optimizer, scheduler, scale=float("inf"))  # skipped by the scaler
    _micro_batch(session, model, optimizer, scheduler)
    assert session.optimizer_steps == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)


def test_epoch_interval_steps_once_per_call() -> None:
    session = gpukit.Session(accelerator="cpu", accumulate_grad_batches=2, verbose=False)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = session.setup_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), interval="epoch")
    model, optimizer = session.setup(model, optimizer)
    for _ in range(2):  # two epochs of 4 micro-batches
        for _ in range(4):
            session.backward(model(torch.ones(1, 4)).sum())
            session.step(optimizer)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_schedule_is_saved_and_resumed_with_the_session(tmp_path) -> None:
    session, model, optimizer, scheduler = _session_and_model(accumulate_grad_batches=2)
    for _ in range(6):
        _micro_batch(session, model, optimizer, scheduler)
    session.save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer)  # scheduler not named
    straight = []
    for _ in range(4):
        _micro_batch(session, model, optimizer, scheduler)
        straight.append(optimizer.param_groups[0]["lr"])

    session, model, optimizer, scheduler = _session_and_model(accumulate_grad_batches=2)
    assert session.resume(tmp_path, model=model, optimizer=optimizer) == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    resumed = []
    for _ in range(4):
        _micro_batch(session, model, optimizer, scheduler)
        resumed.append(optimizer.param_groups[0]["lr"])
    assert resumed == straight


def test_a_resume_without_the_same_schedulers_is_refused(tmp_path) -> None:
    session, model, optimizer, scheduler = _session_and_model()
    _micro_batch(session, model, optimizer, scheduler)
    session.save_checkpoint(tmp_path, 1, model=model)
    fresh = gpukit.Session(accelerator="cpu", verbose=False)
    with pytest.raises(gpukit.errors.CheckpointError, match="1 scheduler\\(s\\) set up with session.setup_scheduler"):
        fresh.resume(tmp_path, model=_model())


def test_bad_interval_and_double_wrapping_are_refused() -> None:
    session, _, optimizer, scheduler = _session_and_model()
    with pytest.raises(ConfigurationError, match="interval='batch'"):
        session.setup_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1), interval="batch")
    with pytest.raises(ConfigurationError, match="pass the torch.optim.lr_scheduler scheduler itself"):
        session.setup_scheduler(scheduler)
