"""Exact resume for real: SIGKILL training after a checkpoint, resume in new processes.

One process, and a 2-process DDP job (gloo): train N steps uninterrupted; separately train,
checkpoint mid-epoch, train on, SIGKILL, resume in fresh processes and train to N. Parameters,
optimizer and scheduler state, data position and each rank's RNG streams must be identical.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpukit

WORKER = Path(__file__).with_name("ckpt_resume_worker.py")


def _start(mode: str, ckpt: Path, out: Path, world: int, init: Path) -> list[subprocess.Popen[str]]:
    extra = lambda rank: [str(rank), str(world), str(init)] if world > 1 else []  # noqa: E731
    return [
        subprocess.Popen([sys.executable, str(WORKER), mode, str(ckpt), f"{out}.rank{rank}", *extra(rank)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        outputs.append(out)
    return outputs


def _crash(ckpt: Path, out: Path, world: int, init: Path) -> list[list[str]]:
    procs = _start("crash", ckpt, out, world, init)
    lines: list[list[str]] = [[] for _ in procs]
    try:
        for proc, seen in zip(procs, lines):
            assert proc.stdout is not None
            while not seen or not seen[-1].startswith("AFTER"):  # synchronise on the pipe, not on time
                line = proc.stdout.readline()
                assert line, f"worker exited early: {proc.stderr.read() if proc.stderr else ''}"
                seen.append(line.strip())
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
    assert all(proc.returncode == -signal.SIGKILL for proc in procs)
    return lines


def _assert_identical(full: dict, resumed: dict) -> None:  # type: ignore[type-arg]
    for key, value in full["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for index, state in full["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, resumed["optimizer"]["state"][index][name]), (index, name)
    assert full["optimizer"]["param_groups"] == resumed["optimizer"]["param_groups"]
    assert full["scheduler"] == resumed["scheduler"] and full["loader"] == resumed["loader"]
    assert torch.equal(full["rng_probe"], resumed["rng_probe"])  # the RNG streams line up too


@pytest.mark.slow
@pytest.mark.extended  # make test: the two-process test below (mid-epoch too, and each rank's file)
def test_sigkill_then_resume_is_bit_identical_mid_epoch(tmp_path: Path) -> None:
    _finish(_start("full", tmp_path / "unused", tmp_path / "full", 1, tmp_path / "pg0"))
    lines = _crash(tmp_path / "ckpt", tmp_path / "never", 1, tmp_path / "pg1")
    assert lines == [["SAVED 7 epoch=0 batches=7", "SAVED 13 epoch=1 batches=3", "AFTER 15"]]
    [out] = _finish(_start("resume", tmp_path / "ckpt", tmp_path / "resumed", 1, tmp_path / "pg2"))
    assert out.splitlines()[0] == "RESUMED 13 epoch=1 batches=3"  # mid-epoch
    _assert_identical(gpukit.load(tmp_path / "full.rank0"), gpukit.load(tmp_path / "resumed.rank0"))


@pytest.mark.slow
def test_two_process_ddp_sigkill_then_resume_is_bit_identical(tmp_path: Path) -> None:
    _finish(_start("full", tmp_path / "unused", tmp_path / "full", 2, tmp_path / "pg0"))
    lines = _crash(tmp_path / "ckpt", tmp_path / "never", 2, tmp_path / "pg1")
    assert all(seen[1] == "SAVED 13 epoch=2 batches=3" for seen in lines)  # 5 batches per epoch and rank
    step_dir = tmp_path / "ckpt" / "step_00000013"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "complete.json", "rank_00000.pt", "rank_00001.pt", "state.pt"]
    outputs = _finish(_start("resume", tmp_path / "ckpt", tmp_path / "resumed", 2, tmp_path / "pg2"))
    assert all(out.splitlines()[0] == "RESUMED 13 epoch=2 batches=3" for out in outputs)
    full = [gpukit.load(tmp_path / f"full.rank{r}") for r in range(2)]
    for rank in range(2):
        _assert_identical(full[rank], gpukit.load(tmp_path / f"resumed.rank{rank}"))
    assert not torch.equal(full[0]["rng_probe"], full[1]["rng_probe"])  # per-rank streams really differ
