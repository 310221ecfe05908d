"""The examples run on the CPU (small settings), as users would start them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=240, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_single_device_tutorial_learns() -> None:
    out = run(str(EXAMPLES / "single_device.py"), "--epochs", "1", "--samples", "256")
    assert "strategy single on cpu" in out and "accuracy on 512 test images" in out


def test_foonet_dataparallel_example() -> None:
    out = run(str(EXAMPLES / "dataparallel_foonet.py"))
    assert "strategy dp" in out and "batch size in forward: 16" in out and "done: 4 steps" in out
    assert "done: 4 steps" in run(str(EXAMPLES / "dataparallel_foonet.py"), "--loss-in-forward")


def test_ddp_example_as_one_plain_process() -> None:
    out = run(str(EXAMPLES / "ddp_train.py"), "--epochs", "1")
    assert "ddp rank 0/1 on cpu with gloo" in out and "final loss per rank" in out


@pytest.mark.slow
def test_ddp_example_launches_two_processes_itself() -> None:
    # session.launch -> gpukit.launch (elastic agent); the torchrun path of the same code is
    # covered by tests/strategies/test_ddp_multiprocess.py
    out = run(str(EXAMPLES / "ddp_train.py"), "--processes", "2", "--epochs", "1")
    assert "ddp rank 0/2 on cpu with gloo" in out and "(mean over 2 ranks)" in out
    losses = out.split("final loss per rank: ")[1].splitlines()[0]
    first, second = ast.literal_eval(losses)
    assert first == second  # all_reduce gave every rank the same mean
