"""The precision asked for is the precision that runs: the model ``session.setup`` returns runs its
forward under the session's autocast, so a loop WITHOUT ``with session.autocast():`` (the loop of
a port from Accelerate or Fabric) computes in bf16 at ``precision="bf16-mixed"`` -- read inside the
model, for every strategy. Before this, such a loop trained in fp32, silently.

single / dp / pipeline run in this process; ddp and fsdp with 2 CPU processes over gloo through the
real launcher (``gpukit run --cpu --nproc 2``), as the other strategy tests do.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _precision_worker as worker  # noqa: E402

import gpukit  # noqa: E402


def _run(out: Path, strategy: str, precision: str, options: str = "") -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    script = [str(Path(worker.__file__)), str(out), strategy, precision, options]
    cmd = ([sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", *script]
           if strategy in ("ddp", "fsdp") else [sys.executable, *script])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _check(records: list[dict[str, Any]], inner: str, autocast: bool, output: str) -> None:
    for record in records:
        assert record["seen"], "no Linear ran"
        assert {s["dtype"] for s in record["seen"]} == {inner}, record["seen"]
        assert {s["autocast"] for s in record["seen"]} == {autocast}, record["seen"]
        assert set(record["out_dtypes"]) == {output}
        assert all(loss == loss for loss in record["losses"])  # finite, not nan
        # checkpoints still load into the plain model: no wrapper prefixes in the keys
        assert record["keys"] == record["plain_keys"]


@pytest.mark.parametrize("strategy", ["single", "dp", "pipeline"])
def test_bf16_mixed_runs_in_bf16_without_session_autocast(tmp_path: Path, strategy: str) -> None:
    records = _run(tmp_path, strategy, "bf16-mixed")
    _check(records, inner="torch.bfloat16", autocast=True, output="torch.float32")


def test_32_true_stays_fp32(tmp_path: Path) -> None:
    _check(_run(tmp_path, "single", "32-true"), inner="torch.float32", autocast=False, output="torch.float32")


@pytest.mark.parametrize("options", ["meta", "ac", "compile"])
def test_bf16_mixed_on_meta_checkpointed_and_compiled_models(tmp_path: Path, options: str) -> None:
    records = _run(tmp_path, "single", "bf16-mixed", options)
    _check(records, inner="torch.bfloat16", autocast=True, output="torch.float32")
    if options == "ac":  # the checkpointed blocks' recompute in backward ran in bf16 as well
        assert any(not s["grad_enabled"] or s["autocast"] for s in records[0]["seen"])
        assert len(records[0]["seen"]) > 2 * 4  # 4 Linears x 2 steps, plus the recomputed blocks


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "options"), [  # make test: each strategy with its options on
    pytest.param("ddp", "", marks=pytest.mark.extended),
    ("ddp", "compile"),
    pytest.param("fsdp", "", marks=[pytest.mark.requires_cpu_fsdp, pytest.mark.extended]),
    pytest.param("fsdp", "meta,ac", marks=pytest.mark.requires_cpu_fsdp),
])
def test_bf16_mixed_on_two_processes(tmp_path: Path, strategy: str, options: str) -> None:
    records = _run(tmp_path, strategy, "bf16-mixed", options)
    assert len(records) == 2
    _check(records, inner="torch.bfloat16", autocast=True, output="torch.float32")
    assert records[0]["losses"] != records[1]["losses"]  # each rank its own batches


def _session(precision: str = "bf16-mixed") -> gpukit.Session:
    return gpukit.Session(accelerator="cpu", precision=precision, verbose=False)


def test_the_set_up_model_copies_pickles_and_sets_up_again() -> None:
    """The autocast forward is an attribute of the model's own, not a closure over it: a deepcopy
    (an EMA model) runs its own weights, a pickled model loads, and setting up twice does not stack."""
    session = _session()
    model = session.setup(worker.make_model())
    x = torch.randn(3, 8)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    assert torch.count_nonzero(ema(x)) == 0 and torch.count_nonzero(model(x)) > 0
    again = pickle.loads(pickle.dumps(model))
    assert torch.equal(again(x), model(x)) and again(x).dtype == torch.float32
    twice = _session().setup(model)
    assert twice.forward.inner is None  # the class's forward, not the first autocast forward
    assert sorted(model.state_dict()) == sorted(worker.make_model().state_dict())


def test_session_autocast_nests_and_the_loss_outside_is_fp32() -> None:
    session = _session()
    model = session.setup(worker.make_model())
    seen: list[dict[str, Any]] = []
    worker.watch(model, seen)
    x = torch.randn(3, 8)
    with session.autocast():
        inside = model(x)
    outside = model(x)
    assert torch.equal(inside, outside) and outside.dtype == torch.float32
    assert {s["dtype"] for s in seen} == {"torch.bfloat16"}
    assert not torch.is_autocast_enabled("cpu")  # left as found


def test_a_data_parallel_the_user_put_on_comes_off_on_one_device() -> None:
    """A script's own nn.DataParallel(model) given to a one-device session was kept: on GPUs it ran over
    every visible GPU whatever devices= said, its replica threads autocast in fp16 (torch's default) under
    "bf16-mixed", and model.module ran in fp32. It comes off, as under every other strategy."""
    session = _session()
    inner = worker.make_model()
    seen: list[dict[str, Any]] = []
    worker.watch(inner, seen)
    model = session.setup(nn.DataParallel(inner))
    assert model is inner and sorted(model.state_dict()) == sorted(worker.make_model().state_dict())
    assert model(torch.randn(3, 8)).dtype == torch.float32
    assert {s["dtype"] for s in seen} == {"torch.bfloat16"} and all(s["autocast"] for s in seen)


def test_the_model_is_unchanged_for_true_precisions() -> None:
    model = _session("32-true").setup(worker.make_model())
    assert "forward" not in vars(model)
    model = _session("bf16-true").setup(worker.make_model())
    assert "forward" not in vars(model)  # the "-true" precisions cast inputs and outputs with hooks
    model = _session("32-true").setup(_session("bf16-mixed").setup(worker.make_model()))
    assert "forward" not in vars(model)  # set up again at fp32: the autocast forward comes off
    assert model(torch.randn(2, 8)).dtype == torch.float32


@pytest.mark.parametrize("again", ["bf16-mixed", "32-true", "16-true"])
def test_a_model_a_true_precision_converted_is_not_set_up_at_another(again: str) -> None:
    """A notebook cell re-run with another precision on the model an earlier cell set up at "bf16-true":
    its weights are bf16 already, so it would train in bf16 while session.precision said otherwise."""
    model = _session("bf16-true").setup(worker.make_model())
    hooks = len(model._forward_hooks)
    with pytest.raises(gpukit.ConfigurationError, match="set up at precision 'bf16-true' before") as info:
        _session(again).setup(model)
    assert "Build the model again" in str(info.value)
    assert len(model._forward_hooks) == hooks  # nothing stacked on it
    assert _session("bf16-true").setup(model) is model  # the same precision again is fine


@pytest.mark.requires_gpu
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_loop_without_session_autocast_runs_16_bit_on_cuda(precision: str) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("no native bf16 on this GPU")
    session = gpukit.Session(devices=1, precision=precision, verbose=False)
    model = worker.make_model()
    seen: list[dict[str, Any]] = []
    worker.watch(model, seen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.setup(model, optimizer)
    x, y = torch.randn(4, 8, device=session.device), torch.randn(4, 1, device=session.device)
    output = model(x)
    session.backward(nn.functional.mse_loss(output, y))
    session.step(optimizer)
    low = "torch.bfloat16" if precision == "bf16-mixed" else "torch.float16"
    assert {s["dtype"] for s in seen} == {low} and output.dtype == torch.float32
