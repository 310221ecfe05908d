"""gpukit.save of an FSDP-sharded model writes the full model, not rank 0's shards (2 processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpukit

sys.path.insert(0, str(Path(__file__).parent))
import _fsdp_save_worker as worker  # noqa: E402


pytestmark = pytest.mark.requires_cpu_fsdp  # FSDP on gloo CPU processes: torch >= 2.7


@pytest.mark.slow
def test_fsdp_model_saved_whole_by_save_and_export(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", worker.__file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert reference["0.weight"].shape == (16, 6)  # full, not a shard
    plain = worker.build()
    for name in ("model.pt", "model.safetensors", "export/model.safetensors"):
        state = gpukit.load(tmp_path / name)  # weights_only: plain tensors, no DTensor
        assert sorted(state) == sorted(reference), name
        for key, tensor in reference.items():
            assert torch.equal(state[key], tensor), (name, key)
        plain.load_state_dict(state, strict=True)
    nested = gpukit.load(tmp_path / "state.pt")
    assert nested["step"] == 1 and all(torch.equal(nested["model"][k], v) for k, v in reference.items())
