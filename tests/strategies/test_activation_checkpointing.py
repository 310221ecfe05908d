"""Activation checkpointing (Session(activation_checkpointing=...)) on every strategy.

Same weights with and without it (no dropout: recompute is exact up to float rounding), state
dict keys of the plain model (no ``_checkpoint_wrapped_module.``), checkpoints that load into
the plain model, and the policies' choice of blocks. DDP and FSDP run as 2 gloo processes.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.strategies import PipelineStrategy
from gpukit.strategies._checkpointing import apply_activation_checkpointing, checkpoint_targets, is_checkpointed

sys.path.insert(0, str(Path(__file__).parent))
import _ac_worker as worker  # noqa: E402


def _train(model: nn.Module, session: gpukit.Session, steps: int = 3) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(6, worker.FEATURES, generator=generator)
        session.backward(model(x).pow(2).mean())
        session.step(optimizer)
    return model


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_single_same_weights_plain_keys_and_checkpoint_loads_into_plain_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = worker.Net()
    reference = _train(copy.deepcopy(base), gpukit.Session("cpu", verbose=False))
    session = gpukit.Session("cpu", verbose=False, activation_checkpointing=True)
    trained = _train(copy.deepcopy(base), session)
    assert session.strategy.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(is_checkpointed(b) for b in trained.blocks) and not is_checkpointed(reference.blocks[0])
    assert trained.blocks[0].__class__ is not worker.Block and isinstance(trained.blocks[0], worker.Block)
    _close(reference.state_dict(), trained.state_dict())  # same keys, same weights
    assert not any("_checkpoint_wrapped_module" in k for k in trained.state_dict())
    # the checkpoint loads into the plain model, and a plain checkpoint into a checkpointed one
    step_dir = session.save_checkpoint(tmp_path, step=3, model=trained)
    plain = worker.Net()
    assert gpukit.CheckpointManager(tmp_path).resume(model=plain) == 3
    _close(plain.state_dict(), reference.state_dict())
    gpukit.load_state_dict(trained, reference.state_dict())
    assert Path(step_dir).is_dir()


def test_policies_choose_blocks() -> None:
    net = worker.Net()
    assert [n for n, _ in checkpoint_targets(net, "selective")] == ["blocks.0", "blocks.2"]
    assert [n for n, _ in checkpoint_targets(net, {nn.Linear})] == ["inp", "blocks.0.fc1", "blocks.0.fc2",
                                                                    "blocks.1.fc1", "blocks.1.fc2",
                                                                    "blocks.2.fc1", "blocks.2.fc2", "head"]
    assert [n for n, _ in checkpoint_targets(net, lambda m, n: n == "head")] == ["head"]
    assert checkpoint_targets(net, None) == [] and checkpoint_targets(net, "none") == []
    resnet_like = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU())
                                                                     for _ in range(3)]))
    assert [n for n, _ in checkpoint_targets(resnet_like, True)] == ["1.0", "1.1", "1.2"]
    with pytest.raises(ConfigurationError, match="found no blocks in Sequential"):
        checkpoint_targets(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), True)
    with pytest.raises(ConfigurationError, match=r"activation_checkpointing=3 is not understood.*'selective'"):
        gpukit.Session("cpu", verbose=False, activation_checkpointing=3)
    with pytest.raises(ConfigurationError, match="give it in one place"):
        gpukit.Session(["cpu", "cpu"], strategy=PipelineStrategy(["cpu", "cpu"], activation_checkpointing="selective"),
                       verbose=False, activation_checkpointing=True)


def test_checkpointed_model_deepcopies_and_recomputes_in_backward() -> None:
    net = worker.Net()
    apply_activation_checkpointing(net, True)
    calls: list[int] = []
    net.blocks[1].fc1.register_forward_hook(lambda *_: calls.append(1))
    net(torch.randn(2, worker.FEATURES)).sum().backward()
    assert len(calls) == 2  # forward, and again in backward
    with torch.no_grad():
        net(torch.randn(2, worker.FEATURES))
    assert len(calls) == 3  # no recompute without a graph
    twin = copy.deepcopy(net)
    assert is_checkpointed(twin.blocks[0]) and twin.blocks[0].fc1.weight is not net.blocks[0].fc1.weight


def test_pipeline_stages_and_compile_give_the_same_weights() -> None:
    torch.manual_seed(0)
    base = worker.Net()
    reference = _train(copy.deepcopy(base), gpukit.Session("cpu", verbose=False))
    layers = ["inp", "blocks.0", "blocks.1", "blocks.2", "head"]
    split = gpukit.Session(strategy=PipelineStrategy(["cpu", "cpu"], layers=layers, verbose=False),
                           verbose=False, activation_checkpointing="selective")
    piped = _train(copy.deepcopy(base), split)
    assert split.strategy.checkpointed == ["blocks.0", "blocks.2"]
    _close(reference.state_dict(), gpukit.unwrap_model(piped).state_dict())
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, True)
    compiled = _train(torch.compile(model), gpukit.Session("cpu", verbose=False))
    _close(reference.state_dict(), gpukit.unwrap_model(compiled).state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.requires_cpu_fsdp)])
def test_two_processes_same_weights_and_checkpoint_loads_plain(strategy: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", worker.__file__, strategy, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    plain_keys = list(worker.Net().state_dict())
    for rec in records:
        assert rec["checkpointed"]["checkpointed"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert rec["plain"]["keys"] == rec["checkpointed"]["keys"] == plain_keys
        _close(rec["plain"]["state"], rec["checkpointed"]["state"])
    _close(records[0]["checkpointed"]["state"], records[1]["checkpointed"]["state"])
    plain = worker.Net()
    step_dir = gpukit.CheckpointManager(tmp_path / "ckpt").latest()
    if strategy == "fsdp":  # sharded (DCP): merged into one file, then loaded strictly
        from gpukit.checkpoint._merge import merge_sharded

        merge_sharded(step_dir, tmp_path / "model.pt", select="model")
        gpukit.load_state_dict(plain, gpukit.load(tmp_path / "model.pt"))
    else:
        gpukit.CheckpointManager(tmp_path / "ckpt").resume(model=plain)
    _close(plain.state_dict(), records[0]["checkpointed"]["state"])
