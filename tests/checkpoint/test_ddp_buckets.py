"""DDP's gradient buckets across a resume (checkpoint/_ddp_buckets.py), in one process.

The layout only changes results from 3 processes on (test_exact_resume_scale.py runs those); here
one gloo process with the threshold lowered shows what is recorded when, that the first resumed
reduction runs in the recorded buckets and puts every gradient back where it belongs, and what is
refused or warned about.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpukit.checkpoint import CheckpointManager
from gpukit.checkpoint import _ddp_buckets
from gpukit.errors import CheckpointError

PARAM_ORDER = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
READY_ORDER = ["2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"]


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_ddp_buckets, "_LAYOUT_MATTERS_FROM", 1)
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> DistributedDataParallel:
    # two 2 MiB weights: DDP's rebuilt first bucket closes past 1 MiB, after the second one
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 1)))


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()


def _saved_after_a_step(directory: Path) -> DistributedDataParallel:
    """A wrapper that trained one step (its buckets rebuilt), checkpointed in ``directory``."""
    trained = _model()
    _backward(trained, 1)
    CheckpointManager(directory).save(1, model=trained)
    return trained


def _record(model: DistributedDataParallel) -> list[list[str]]:
    return _ddp_buckets.record_ddp_buckets({"model": model}, is_main=True)["model"]


@pytest.mark.usefixtures("one_process_group")
def test_a_save_records_the_buckets_the_next_reduction_uses() -> None:
    model = _model()
    assert _record(model) == [PARAM_ORDER]  # a new wrapper: one bucket in parameter order
    _backward(model, 1)  # DDP would rebuild at the next forward; the save does it now
    layout = _record(model)
    assert [n for bucket in layout for n in bucket] == READY_ORDER and len(layout) == 2
    assert layout[-1] == ["0.bias", "0.weight"]
    _backward(model, 2)
    assert _record(model) == layout  # DDP rebuilds once


@pytest.mark.usefixtures("one_process_group")
def test_the_first_resumed_reduction_runs_in_the_recorded_buckets(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = _record(_saved_after_a_step(tmp_path))
    resumed = _model()
    CheckpointManager(tmp_path).resume(model=resumed)
    assert _record(resumed) == recorded  # saved again before a step: still the recorded layout

    sizes: list[int] = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (sizes.append(t.numel()), real(t, *a, **k))[1])
    _backward(resumed, 2)
    params = dict(resumed.module.named_parameters())
    assert sizes == [sum(params[n].numel() for n in bucket) for bucket in recorded]  # not one start-up bucket
    plain = _model().module
    _backward(plain, 2)
    for (name, p), q in zip(resumed.module.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name  # every gradient copied back to its own parameter

    sizes.clear()
    _backward(resumed, 3)  # DDP's own reduction now: its rebuilt buckets, the same as recorded
    assert sizes == [sum(params[n].numel() for n in bucket) for bucket in recorded]


@pytest.mark.usefixtures("one_process_group")
def test_a_model_with_its_own_comm_hook_resumes_with_a_warning(tmp_path: Path) -> None:
    _saved_after_a_step(tmp_path)
    resumed = _model()
    resumed.register_comm_hook(None, lambda state, bucket: dist.all_reduce(  # type: ignore[arg-type, return-value]
        bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))
    with pytest.warns(UserWarning, match="communication hook of its own"):
        CheckpointManager(tmp_path).resume(model=resumed)


@pytest.mark.usefixtures("one_process_group")
def test_a_layout_of_other_parameters_is_not_replayed(tmp_path: Path) -> None:
    _saved_after_a_step(tmp_path)
    resumed = _model()
    resumed.module[0].bias.requires_grad_(False)  # DDP reduces other parameters than were recorded
    with pytest.warns(UserWarning, match="do not hold exactly the parameters it trains"):
        CheckpointManager(tmp_path).resume(model=resumed)
    assert getattr(resumed, "_gpukit_replay", None) is None


@pytest.mark.parametrize("saved", [
    ["model"], {"model": "0.weight"}, {"model": [["0.weight", 3]]}, {"model": [[["nested"]]]},
    {"model": [["x" * 5000]]}, {7: [["0.weight"]]},
], ids=["list", "string", "number", "nested", "long-name", "number-key"])
def test_recorded_buckets_that_gpukit_never_writes_are_refused(saved: object) -> None:
    with pytest.raises(CheckpointError, match="recorded gradient buckets .* damaged or was not written by gpukit"):
        _ddp_buckets.check_ddp_buckets(saved, "ckpt/step_00000001/state.pt")


def test_one_or_two_processes_record_nothing(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        _backward(model, 1)
        assert _ddp_buckets.record_ddp_buckets({"model": model}, is_main=True) == {}  # a + b == b + a
    finally:
        dist.destroy_process_group()
