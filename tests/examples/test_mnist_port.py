"""The worked port (examples/mnist_port): its diff is the whole change, and in one process it trains exactly
as the original does -- the same loss at every logged step (issue 41.14 and 41.17)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PORT = Path(__file__).resolve().parents[2] / "examples" / "mnist_port"


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(PORT / script), "--synthetic", "128", "--epochs", "2",
                           "--log-interval", "1", "--batch-size", "32"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=PORT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _losses(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(r"Loss: ([0-9.]+)", proc.stdout) + re.findall(r"Average loss: ([0-9.]+)", proc.stdout)


def test_the_port_trains_exactly_as_the_original() -> None:
    run = _run("with_gpukit.py")
    original, ported = _losses(_run("original.py")), _losses(run)
    # 128 samples, not more: two epochs of a few batches show the per-step and per-epoch RNG agreement
    assert len(original) == 2 * 4 + 2  # 4 batches an epoch, each logged, and two test passes
    # dropout draws from the global RNG: gpukit's loader draws what torch's would at each epoch's start
    assert ported == original
    # issue 41.15: one epoch line per training pass, counted from 1; the test loader's passes print none
    assert re.findall(r"gpukit: epoch (\d+):", run.stderr) == ["1", "2"], run.stderr


def test_port_diff_is_the_whole_change() -> None:
    made = subprocess.run(["diff", "-u", "original.py", "with_gpukit.py"], capture_output=True, text=True, cwd=PORT)
    kept = (PORT / "port.diff").read_text().splitlines()
    assert made.stdout.splitlines()[2:] == kept[2:]  # after the two header lines, which carry dates
