"""OomBackoff: halve the micro-batch on out-of-memory, keep the maths, agree across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.memory import OomBackoff, OutOfMemoryAfterBackoffError
from gpukit.memory._backoff import split_batch


def _model_and_batch() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    return model, (torch.randn(16, 6), torch.randn(16, 3))


def test_gradients_after_backoff_equal_full_batch_gradients() -> None:
    model, (x, y) = _model_and_batch()
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    alive_after_failure: list[weakref.ref] = []
    seen_dead_before_retry: list[bool] = []

    def step(micro: tuple[torch.Tensor, torch.Tensor], weight: float) -> float:
        if alive_after_failure:  # the retry starts only after the failed attempt's tensors died
            seen_dead_before_retry.append(all(ref() is None for ref in alive_after_failure))
        activations = torch.empty(micro[0].shape[0], 1024)  # what a failed forward would hold
        if micro[0].shape[0] > 4:
            alive_after_failure.append(weakref.ref(activations))
            (loss := nn.functional.mse_loss(model(micro[0]), micro[1]) * weight).backward()  # partial grads
            raise torch.OutOfMemoryError("injected")
        loss = nn.functional.mse_loss(model(micro[0]), micro[1]) * weight
        loss.backward()
        return loss.item()

    events = []
    backoff = OomBackoff(16, zero_grad=model.zero_grad, on_backoff=events.append)
    results = backoff.run(step, (x, y))
    assert backoff.micro_batch_size == 4 and backoff.accumulation_steps == 4 and len(results) == 4
    assert [(e.old_micro_batch_size, e.new_micro_batch_size) for e in events] == [(16, 8), (8, 4)]
    assert events[-1].accumulation_steps == 4
    assert seen_dead_before_retry and all(seen_dead_before_retry)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_uneven_split_keeps_the_mean() -> None:
    model, (x, y) = _model_and_batch()
    x, y = x[:13], y[:13]
    nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    backoff = OomBackoff(5, zero_grad=model.zero_grad)
    backoff.run(lambda m, w: (nn.functional.mse_loss(model(m[0]), m[1]) * w).backward(), (x, y))
    assert backoff.accumulation_steps == 3
    for got, want in zip((p.grad for p in model.parameters()), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_out_of_memory_at_the_minimum_raises_a_catchable_oom() -> None:
    def always_oom(micro: torch.Tensor, weight: float) -> None:
        raise torch.OutOfMemoryError("injected")

    backoff = OomBackoff(8, min_micro_batch_size=2)
    with pytest.raises(torch.OutOfMemoryError, match="min_micro_batch_size=2"):
        backoff.run(always_oom, torch.zeros(8, 2))
    with pytest.raises(OutOfMemoryAfterBackoffError):
        OomBackoff(1).run(always_oom, torch.zeros(8, 2))


def test_other_errors_are_not_swallowed() -> None:
    def broken(micro: torch.Tensor, weight: float) -> None:
        raise RuntimeError("CUDA out of memory (but not the OOM type)")  # message alone means nothing

    with pytest.raises(RuntimeError, match="not the OOM type"):
        OomBackoff(8).run(broken, torch.zeros(8, 2))


def test_split_batch_handles_nested_batches_and_rejects_tensorless_ones() -> None:
    batch = {"x": torch.arange(10), "pair": (torch.zeros(10, 2), "tag")}
    parts = list(split_batch(batch, 4))
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert parts[2]["pair"][0].shape == (2, 2) and parts[2]["pair"][1] == "tag"
    with pytest.raises(ConfigurationError, match="no tensor"):
        OomBackoff(2).run(lambda m, w: None, ["a", "b"])
    with pytest.raises(ConfigurationError):
        OomBackoff(0)


def _start_backoff_workers(tmp_path: Path, *extra: str) -> list[subprocess.Popen]:
    worker = Path(__file__).with_name("_ddp_backoff_worker.py")
    env = {**os.environ, "WORLD_SIZE": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    return [
        subprocess.Popen(
            [sys.executable, str(worker), str(tmp_path / "store"), str(tmp_path / f"rank{r}.json"), *extra],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]


@pytest.mark.slow
def test_rank_out_of_memory_inside_a_ddp_forward_with_buffers_does_not_hang(tmp_path: Path) -> None:
    # DDP broadcasts BatchNorm buffers in forward; the rank whose forward died must not be the
    # only one to broadcast on the retry (it used to hang both ranks)
    procs = _start_backoff_workers(tmp_path, "norm")
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=90)
            assert proc.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["micro_batch_size"] for r in results] == [4, 4]


@pytest.mark.slow
def test_two_ranks_agree_after_one_rank_runs_out_of_memory(tmp_path: Path) -> None:
    procs = _start_backoff_workers(tmp_path)
    for proc in procs:  # nobody hangs: both finish well within the timeout
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 0 never failed, yet it followed rank 1 down to 4, and both stayed there
    assert [(r["micro_batch_size"], r["second_micro"], r["accumulation_steps"], r["events"]) for r in results] == [(4, 4, 4, 2)] * 2
    # gradients are the all-rank mean of full-batch gradients, identical on both ranks
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    for r in results:
        x, y = (torch.tensor(t) for t in r["batch"])
        (nn.functional.mse_loss(model(x), y) / 2).backward()
    expected = [p.grad for p in model.parameters()]
    for r in results:
        for got, want in zip(r["grads"], expected):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
