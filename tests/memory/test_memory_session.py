"""Memory through gpukit.Session: run_step with OOM back-off, post-mortems, leak watching,
reports, free_memory and the inference guard."""

from __future__ import annotations

import warnings

import pytest
import torch
from _session_oom_worker import OomAbove, ddp_job, make_batch, make_model, make_optimizer, train_reference
from torch import nn
from torch.nn import functional as F

import gpukit
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory import (
    InferenceGradWarning,
    LeakWatcher,
    MemoryLeakWarning,
    OutOfMemoryAfterBackoffError,
    StepOutOfMemoryError,
)


def _session(**options) -> gpukit.Session:
    options.setdefault("precision", "32-true")
    return gpukit.Session(devices="cpu", verbose=False, **options)


def _train(session: gpukit.Session, model: nn.Module, batches: list, arm_at: int | None = None) -> list[torch.Tensor]:
    """run_step + step over ``batches``; the injected OOM is armed from batch ``arm_at`` on."""
    model, optimizer = session.setup(model, make_optimizer(model))
    losses = []
    for i, batch in enumerate(batches):
        gpukit.unwrap_model(model)[1].armed = arm_at is not None and i >= arm_at
        losses.append(session.run_step(lambda b: F.mse_loss(model(b[0]), b[1]), batch))
        session.step(optimizer)
    return losses


# -- OOM back-off ------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_backoff_halves_micro_batch_and_keeps_the_maths(where: str) -> None:
    batches = [make_batch(step) for step in range(6)]
    expected = train_reference(batches, accumulate=2)
    session = _session(oom="backoff", accumulate_grad_batches=2)
    model = make_model(limit=4, where=where)
    # armed from batch 1: the OOM hits the second batch of an accumulation window, after the
    # first one left gradients that must survive the failed attempts
    losses = _train(session, model, batches, arm_at=1)
    backoff = session.oom_backoff
    assert backoff is not None
    assert [(e.old_micro_batch_size, e.new_micro_batch_size, e.accumulation_steps) for e in backoff.events] == [
        (16, 8, 2), (8, 4, 4),
    ]
    assert backoff.micro_batch_size == 4 and backoff.accumulation_steps == 4  # kept for later steps
    assert model[1].raised == 2 and session.optimizer_steps == 3
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    reference_losses = _train(_session(accumulate_grad_batches=2), make_model(), batches)
    torch.testing.assert_close(torch.stack(losses), torch.stack(reference_losses), rtol=1e-5, atol=1e-6)
    assert not any(loss.requires_grad for loss in losses)  # `total += session.run_step(...)` is safe


def test_backed_off_micro_batch_survives_a_checkpoint(tmp_path) -> None:
    batches = [make_batch(step) for step in range(3)]
    session = _session(oom="backoff")
    model = make_model(limit=4)
    _train(session, model, batches, arm_at=0)
    assert session.oom_backoff.micro_batch_size == 4
    session.save_checkpoint(tmp_path, 3, model=model)

    resumed = _session(oom="backoff")
    fresh = make_model(limit=4)
    fresh[1].armed = True
    assert resumed.resume(tmp_path, model=fresh) == 3
    assert resumed.oom_backoff is not None and resumed.oom_backoff.micro_batch_size == 4
    _train(resumed, fresh, batches, arm_at=0)
    assert fresh[1].raised == 0  # starts at the size that fits: no out-of-memory again
    assert _session().state_dict()["oom_micro_batch_size"] is None


def test_backoff_composes_with_fp16_grad_scaler() -> None:
    batches = [make_batch(step) for step in range(4)]
    reference = make_model()
    plain = _session(precision="16-mixed", accumulate_grad_batches=2)
    _train(plain, reference, batches)
    session = _session(precision="16-mixed", accumulate_grad_batches=2, oom="backoff")
    model = make_model(limit=4, where="backward")
    _train(session, model, batches, arm_at=0)
    assert session.oom_backoff.micro_batch_size == 4 and session.optimizer_steps == plain.optimizer_steps == 2
    assert session.precision.scaler.get_scale() == plain.precision.scaler.get_scale()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4)


def test_backoff_without_oom_is_bit_identical_to_the_manual_loop() -> None:
    batches = [make_batch(step) for step in range(4)]
    model = make_model()
    _train(_session(oom="backoff", accumulate_grad_batches=2), model, batches)

    manual = make_model()
    session = _session(accumulate_grad_batches=2)
    manual_ddp, optimizer = session.setup(manual, make_optimizer(manual))
    for x, y in batches:
        with session.accumulate(manual_ddp):
            with session.autocast():
                loss = F.mse_loss(manual_ddp(x), y)
            session.backward(loss)
        session.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), manual.parameters()))


def test_oom_raise_writes_the_postmortem_into_the_error() -> None:
    session = _session(oom="raise")
    model = make_model(limit=4)
    model, optimizer = session.setup(model, make_optimizer(model))
    model[1].armed = True
    with pytest.raises(StepOutOfMemoryError) as caught:
        session.run_step(lambda b: F.mse_loss(model(b[0]), b[1]), make_batch(0))
    message = str(caught.value)
    assert "batch of 16 items" in message and "Session(oom='raise')" in message
    assert "no allocator snapshot on cpu" in message and "largest live CPU tensors" in message
    assert "oom='backoff'" in message  # the fix
    assert isinstance(caught.value, torch.OutOfMemoryError) and isinstance(caught.value, MemoryPlanError)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)


def test_default_lets_torch_oom_through_untouched() -> None:
    session = _session()
    model = make_model(limit=4)
    model, optimizer = session.setup(model, make_optimizer(model))
    model[1].armed = True
    with pytest.raises(torch.OutOfMemoryError) as caught:
        session.run_step(lambda b: F.mse_loss(model(b[0]), b[1]), make_batch(0))
    assert not isinstance(caught.value, StepOutOfMemoryError)


def test_backoff_that_cannot_recover_raises_with_postmortem_and_keeps_earlier_grads() -> None:
    session = _session(oom="backoff", accumulate_grad_batches=2)
    model = make_model(limit=0)  # even one item "does not fit"
    model, optimizer = session.setup(model, make_optimizer(model))
    step_fn = lambda b: F.mse_loss(model(b[0]), b[1])  # noqa: E731
    session.run_step(step_fn, make_batch(0))
    session.step(optimizer)
    earlier = [p.grad.clone() for p in model.parameters()]
    model[1].armed = True
    with pytest.raises(OutOfMemoryAfterBackoffError) as caught:
        session.run_step(step_fn, make_batch(1))
    message = str(caught.value)
    assert "min_micro_batch_size=1" in message and "largest live CPU tensors" in message
    assert isinstance(caught.value, StepOutOfMemoryError)
    assert [e.new_micro_batch_size for e in session.oom_backoff.events] == [8, 4, 2, 1]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), earlier))


def test_run_step_input_errors() -> None:
    session = _session()
    with pytest.raises(ConfigurationError, match="setup"):
        session.run_step(lambda b: b.sum(), torch.zeros(2, 2))
    a, b = session.setup(nn.Linear(2, 1)), session.setup(nn.Linear(2, 1))
    with pytest.raises(ConfigurationError, match="model=model"):
        session.run_step(lambda x: a(x).mean(), torch.zeros(2, 2))
    with pytest.raises(ConfigurationError, match=r"shape \(2, 1\).*scalar"):
        session.run_step(lambda x: a(x), torch.zeros(2, 2), model=a)
    loss = session.run_step(lambda x: b(x).mean(), torch.zeros(2, 2), model=b)
    assert loss.shape == () and not loss.requires_grad and b.weight.grad is not None


@pytest.mark.parametrize(
    "options, match",
    [
        ({"oom": "retry"}, r"oom='retry'.*None, 'raise', 'backoff'"),
        ({"watch_memory": 0}, "int >= 1"),
        ({"watch_memory": "often"}, "watch_memory='often'"),
        ({"oom": "backoff", "sync_batchnorm": True}, "SyncBatchNorm"),
    ],
)
def test_bad_memory_options_are_configuration_errors(options: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _session(**options)


@pytest.mark.slow
def test_ddp_ranks_agree_when_only_rank_one_runs_out_of_memory() -> None:
    from gpukit.launch import launch_function

    steps, accumulate = 4, 2
    results = launch_function(ddp_job, (steps, accumulate, 1), nproc=2, cpu=True, echo=None)
    rank0, rank1 = sorted(results, key=lambda r: r["rank"])
    assert rank1["raised"] == 2 and rank0["raised"] == 0  # only rank 1 ran out of memory...
    for result in (rank0, rank1):  # ...yet both backed off together, to the same size
        assert result["events"] == [(16, 8, 1), (8, 4, 1)]
        assert result["micro_batch_size"] == 4 and result["accumulation_steps"] == 4
        assert result["optimizer_steps"] == steps // accumulate
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"]))
    # the same training on one process, on both ranks' batches at once, without any OOM
    batches = [tuple(torch.cat(parts) for parts in zip(make_batch(s, 0), make_batch(s, 1))) for s in range(steps)]
    for got, want in zip(rank0["params"], train_reference(batches, accumulate)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- leaks -------------------------------------------------------------------------------------
def test_watch_memory_names_total_loss_within_20_steps() -> None:
    session = _session(watch_memory=True)
    model = make_model()
    model, optimizer = session.setup(model, make_optimizer(model))
    total_loss = torch.zeros(())
    found_at = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 21):
            x, y = make_batch(step)
            loss = F.mse_loss(model(x), y)
            session.backward(loss)
            session.step(optimizer)
            total_loss += loss  # the leak: every step's graph stays reachable
            if found_at is None and any(issubclass(w.category, MemoryLeakWarning) for w in caught):
                found_at = step
    assert found_at is not None and found_at <= 20
    leak = next(str(w.message) for w in caught if issubclass(w.category, MemoryLeakWarning))
    assert "`total_loss`" in leak and "loss.item()" in leak


def test_clean_session_loop_is_silent() -> None:
    session = _session()
    model = make_model()
    model, optimizer = session.setup(model, make_optimizer(model))
    watcher = session.watch_memory(every_n_steps=10)
    assert isinstance(watcher, LeakWatcher) and watcher.device == torch.device("cpu")
    batches = [make_batch(step, size=8) for step in range(8)]
    total_loss, history = torch.zeros(()), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryLeakWarning)
        for step in range(300):
            loss = session.run_step(lambda b: F.mse_loss(model(b[0]), b[1]), batches[step % 8])
            session.step(optimizer)
            total_loss += loss  # run_step's loss is detached: no graph kept
            history.append(loss.item())
    assert watcher.checks == 30 and watcher.findings == []


# -- reports, free_memory, inference guard -----------------------------------------------------
def test_memory_report_and_free_memory_on_cpu() -> None:
    session = _session()
    report = session.memory_report()
    assert [row.device for row in report.devices] == ["cpu"]
    assert report["cpu"].process_rss_bytes > 0 and "cpu" in str(report)
    assert session.free_memory() is None  # the CPU has no allocator cache to give back


def test_inference_guard_installed_by_setup_and_removed_by_close() -> None:
    session = _session()
    model = session.setup(make_model())
    assert len(model._forward_hooks) == 1
    session.setup(model)  # set up again: no second guard
    assert len(model._forward_hooks) == 1
    model.eval()
    x = torch.randn(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", InferenceGradWarning)
        with torch.no_grad():
            kept = [model(x) for _ in range(5)]  # the right way: silent
    with pytest.warns(InferenceGradWarning, match="no_grad"):
        kept = [model(x) for _ in range(5)]  # eval mode, grad on, outputs kept
    del kept
    session.close()
    assert len(model._forward_hooks) == 0


# -- real CUDA ---------------------------------------------------------------------------------
class _Blowup(nn.Module):
    """Each item expands to ``cols`` floats: memory grows with the batch, parameters do not."""

    def __init__(self, cols: int) -> None:
        super().__init__()
        self.cols = cols
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n, 1) -> loss = mean_i x_i * w
        return (x.expand(-1, self.cols) * self.w).mean()


def _cuda_blowup_session(oom: str) -> tuple[gpukit.Session, nn.Module, torch.Tensor]:
    torch.cuda.empty_cache()
    free_bytes, _ = torch.cuda.mem_get_info()
    # 64 items need ~2x the free memory for the forward alone; 4 items fit with room to spare
    cols = free_bytes // 32 // 4
    session = gpukit.Session(devices="cuda", precision="32-true", oom=oom, verbose=False)
    model = session.setup(_Blowup(cols))
    x = torch.rand(64, 1, device=session.device) + 0.5
    return session, model, x


@pytest.mark.requires_gpu
def test_real_cuda_oom_is_recovered_by_backoff() -> None:
    session, model, x = _cuda_blowup_session("backoff")
    loss = session.run_step(model, x)
    backoff = session.oom_backoff
    assert backoff is not None and backoff.events and backoff.micro_batch_size < 64
    assert 64 % backoff.micro_batch_size == 0
    torch.testing.assert_close(model.w.grad, x.mean(), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(loss, x.mean().detach(), rtol=1e-3, atol=1e-5)
    del model, x, loss
    assert session.free_memory() is not None
    session.close()


@pytest.mark.requires_gpu
def test_real_cuda_oom_with_raise_writes_allocator_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUKIT_OOM_DIR", str(tmp_path))
    session, model, x = _cuda_blowup_session("raise")
    with pytest.raises(StepOutOfMemoryError, match="memory_viz") as caught:
        session.run_step(model, x)
    assert isinstance(caught.value.__cause__, torch.cuda.OutOfMemoryError)
    assert len(list(tmp_path.glob("gpukit-oom-*.pickle"))) == 1
    del caught, model, x
    session.free_memory()
    session.close()


@pytest.mark.requires_gpu
def test_watch_memory_on_cuda_names_total_loss() -> None:
    session = gpukit.Session(devices="cuda", precision="32-true", verbose=False, watch_memory=10)
    model = make_model()
    model, optimizer = session.setup(model, make_optimizer(model))
    total_loss = torch.zeros((), device=session.device)
    with pytest.warns(MemoryLeakWarning, match="total_loss"):
        for step in range(20):
            x, y = session.to_device(make_batch(step))
            loss = F.mse_loss(model(x), y)
            session.backward(loss)
            session.step(optimizer)
            total_loss += loss
    session.close()


def test_oom_above_helper_is_inert_until_armed() -> None:
    layer = OomAbove(limit=2)
    assert layer(torch.zeros(5, 1)).shape == (5, 1)
    layer.armed = True
    with pytest.raises(torch.OutOfMemoryError):
        layer(torch.zeros(5, 1))
