"""Two DDP processes on one GPU (`gpukit run --gpus 1 --nproc 2`): gloo carries the CUDA tensors.

nccl refuses two ranks on one device ("Duplicate GPU detected"); the selection logic is tested on
the CPU in test_strategy_select.py, the real run needs the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("_shared_gpu_worker.py")


@pytest.mark.requires_gpu
def test_two_ranks_on_one_gpu_train_in_step_over_gloo(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "gpukit", "run", "--gpus", "1", "--nproc", "2", str(WORKER),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:0"] and {r["backend"] for r in ranks} == {"gloo"}
    for key, value in ranks[0]["state"].items():  # the gradients were averaged: one model on both ranks
        torch.testing.assert_close(ranks[1]["state"][key], value)
    assert "2 processes share cuda:0" in proc.stderr
