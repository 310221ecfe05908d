"""Fault injection: SIGKILL a saving process at random moments, many times."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager

WORKER = Path(__file__).with_name("ckpt_fault_worker.py")
MIN_SAVES, MIN_KILLS = 50, 5


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker died: {proc.stderr.read() if proc.stderr else ''}"
    return line.strip()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "background"])
def test_sigkill_at_random_moments_never_loses_the_latest_complete_checkpoint(tmp_path: Path, mode: str) -> None:
    """Plain saves, and background saves (SIGKILL while the files are written, the model already
    changed for the next step): a new process resumes a complete step, bit-exact."""
    rng = random.Random(1234)
    saves = kills = 0
    last_saved = 0  # newest step the worker reported complete before it was killed
    # saves complete beyond the last one reported: the one in progress (its rename may have
    # happened), and with background saves the one after it (reported one save later)
    ahead = 1 if mode == "plain" else 2
    while saves < MIN_SAVES or kills < MIN_KILLS:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)] + ([mode] if mode != "plain" else []),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            head = _read_line(proc).split()
            resumed, single = int(head[1]), int(head[3])
            assert last_saved <= resumed <= last_saved + ahead, (head, last_saved)
            assert last_saved <= single <= last_saved + ahead + 1, (head, last_saved)
            for _ in range(rng.randint(10, 14)):
                _, step, leftovers = _read_line(proc).split()
                saves += 1
                last_saved = int(step)
                assert leftovers == "0", f"temporary files accumulate after save {step}"
            # A random moment inside the next saves (a random kill point, not synchronisation).
            deadline = time.monotonic() + rng.uniform(0.0, 0.03)
            while time.monotonic() < deadline:
                pass
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        # saves the worker reported before the kill but this loop had not read yet (the pipe
        # runs ahead of the reader): the newest of them is what the next process must find
        assert proc.stdout is not None
        for line in proc.stdout.read().splitlines():
            _, step, leftovers = line.split()
            saves += 1
            last_saved = int(step)
            assert leftovers == "0", f"temporary files accumulate after save {step}"
        kills += 1
        # what a new process sees right after the crash: the latest complete checkpoint loads
        model = nn.Linear(16, 16)
        step = CheckpointManager(tmp_path / "managed", keep_last=2).resume(model=model)
        assert step is not None and step >= last_saved
        assert torch.equal(model.weight, torch.full_like(model.weight, float(step)))
        single = gpukit.load(tmp_path / "single.pt")
        assert single["step"] >= last_saved and torch.equal(single["w"], torch.full((4096,), float(single["step"])))
    assert saves >= MIN_SAVES and kills >= MIN_KILLS
