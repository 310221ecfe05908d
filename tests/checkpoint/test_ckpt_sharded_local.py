"""Sharded <-> unsharded checkpoints in one process (an FSDP session of world size 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager

pytestmark = pytest.mark.requires_cpu_fsdp  # FSDP on gloo CPU processes: torch >= 2.7


def _pair(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def test_unsharded_checkpoint_continues_under_fsdp_and_back(tmp_path: Path) -> None:
    plain, plain_opt = _pair(0)
    _step(plain, plain_opt)
    CheckpointManager(tmp_path / "plain").save(1, model=plain, optimizer=plain_opt)
    _step(plain, plain_opt)  # the reference's second step

    session = gpukit.Session(strategy="fsdp", accelerator="cpu", verbose=False)
    try:
        model, optimizer = session.setup(*_pair(1))  # other initial values: all must come from the file
        assert CheckpointManager(tmp_path / "plain").resume(model=model, optimizer=optimizer) == 1
        _step(model, optimizer)  # equal only if Adam's moments and step count were restored
        for key, value in _full(plain).items():
            torch.testing.assert_close(_full(model)[key], value, msg=key)
        session.save_checkpoint(tmp_path / "sharded", 2, model=model, optimizer=optimizer)
        sharded_state = _full(model)
    finally:
        session.close()

    assert (tmp_path / "sharded" / "step_00000002" / ".metadata").is_file()
    again, again_opt = _pair(2)  # plain again, no process group: DCP reads the shards itself
    assert CheckpointManager(tmp_path / "sharded").resume(model=again, optimizer=again_opt) == 2
    for key, value in sharded_state.items():
        assert torch.equal(again.state_dict()[key], value), key
    assert int(again_opt.state_dict()["state"][0]["step"]) == 2
