"""Sharded (FSDP) checkpoints for real: `gpukit run --cpu` processes, SIGKILL, other world sizes.

One module-scoped set of runs (each launch costs seconds on a small CPU):
  full    2 processes train STEPS steps uninterrupted, saving at the end;
  crash   2 processes save at steps 2 and 3 in the background (steps 3 and 4 train while the
          shards are written), then rank 0 is SIGKILLed after step 4;
  res2    2 processes resume the crash's latest checkpoint (step 3) -> bit-exact with full;
  res1    1 process resumes the same checkpoint (2 -> 1), saving at step 4;
  res12   2 processes resume res1's step 4 (1 -> 2).
The full run's last checkpoint is then merged (gpukit ckpt convert) and inspected.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ckpt_sharded_worker.py")
sys.path.insert(0, str(WORKER.parent))
import ckpt_sharded_worker as worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.requires_cpu_fsdp]  # FSDP on gloo CPU processes: torch >= 2.7


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _run(nproc: int, ckpt: Path, out: Path, *args: str, expect_kill: bool = False) -> None:
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", str(nproc), str(WORKER),
           str(ckpt), str(out), *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    if expect_kill:  # the launcher blames rank 0's SIGKILL (and stops rank 1): exit 128 + 9
        root = next((line for line in proc.stderr.splitlines()
                     if line.startswith("gpukit: rank ") and "failed:" in line), "")
        assert proc.returncode == 137 and root.startswith("gpukit: rank 0 ") and "killed by SIGKILL" in root, \
            proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("sharded")
    _run(2, tmp / "full", tmp / "full.pt", "--save", str(worker.STEPS))
    _run(2, tmp / "ck", tmp / "never.pt", "--save", "2,3", "--kill-after", "4", "--background", expect_kill=True)
    shutil.copytree(tmp / "ck", tmp / "ck1")
    _run(2, tmp / "ck", tmp / "res2.pt")
    _run(1, tmp / "ck1", tmp / "res1.pt", "--save", "4")
    _run(2, tmp / "ck1", tmp / "res12.pt")
    found = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in ("full", "res2", "res1", "res12")}
    found["dirs"] = {"tmp": tmp}
    return found


def test_layout_shards_inside_the_atomic_step_directory(runs: dict[str, dict]) -> None:
    step = runs["dirs"]["tmp"] / "full" / f"step_{worker.STEPS:08d}"
    names = sorted(p.name for p in step.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "complete.json",
                     "rank_00000.pt", "rank_00001.pt", "state.pt"]
    marker = json.loads((step / "complete.json").read_text())
    assert set(marker["files"]) == set(names) - {"complete.json"}  # shards and index are size-checked
    assert marker["world_size"] == 2


def test_exact_resume_after_sigkill_at_the_same_world_size(runs: dict[str, dict]) -> None:
    assert runs["res2"]["start"] == 3  # the latest complete checkpoint before the kill
    for key, value in runs["full"]["state"].items():
        assert torch.equal(runs["res2"]["state"][key], value), key


@pytest.mark.parametrize("name, start", [("res1", 3), ("res12", 4)])
def test_resume_at_another_world_size(runs: dict[str, dict], name: str, start: int) -> None:
    # the same global batches: equal to the uninterrupted run up to float rounding
    assert (runs[name]["start"], runs[name]["world_size"]) == (start, 1 if name == "res1" else 2)
    for key, value in runs["full"]["state"].items():
        torch.testing.assert_close(runs[name]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("background", [False, True])
def test_a_rank_failing_during_save_leaves_no_checkpoint_and_no_hang(tmp_path: Path, background: bool) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = tmp_path / "report.json"
    procs = []
    for rank in (0, 1):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "GPUKIT_CKPT_TIMEOUT_S": "20"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "ck"), str(report),
                                       "--faults"] + (["--background"] if background else []),
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]  # no hang
    assert procs[0].returncode == 0, outputs[0][-3000:]
    assert procs[1].returncode == -signal.SIGKILL  # the third save killed it
    seen = json.loads(report.read_text())
    assert seen["1"] == "saved"
    assert "rank 1: OSError" in seen["2"] and "No space left on device" in seen["2"]
    assert "rank(s) 1 did not take part" in seen["3"]
    step1 = str(tmp_path / "ck" / "step_00000001")
    assert seen["latest_after_2"] == seen["latest_after_3"] == step1


def test_merged_checkpoint_loads_into_the_plain_model(runs: dict[str, dict]) -> None:
    from safetensors.torch import load_file

    tmp = runs["dirs"]["tmp"]
    merged = tmp / "model.safetensors"
    proc = subprocess.run([sys.executable, "-m", "gpukit", "ckpt", "convert", str(tmp / "full"), str(merged)],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plain = worker.Stack()
    plain.load_state_dict(load_file(merged), strict=True)  # the plain model's keys, complete
    for key, value in plain.state_dict().items():
        assert torch.equal(value, runs["full"]["state"][key]), key


def test_merge_loads_a_bounded_group_at_a_time(runs: dict[str, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from gpukit.checkpoint import _merge

    step = runs["dirs"]["tmp"] / "full" / f"step_{worker.STEPS:08d}"
    loaded: list[int] = []
    real_load = _merge._load

    def counting(*args: object) -> dict[str, torch.Tensor]:
        group = real_load(*args)  # type: ignore[arg-type]
        loaded.append(sum(t.numel() * t.element_size() for t in group.values()))
        return group

    monkeypatch.setattr(_merge, "_load", counting)
    largest = max(v.numel() * v.element_size() for v in runs["full"]["state"].values())  # 12x12 fp32
    target = runs["dirs"]["tmp"] / "small-budget.safetensors"
    _merge.merge_sharded(step, target, budget_bytes=largest)
    assert len(loaded) > 3 and max(loaded) <= largest  # never the whole model at once
    assert sum(loaded) == sum(v.numel() * v.element_size() for v in runs["full"]["state"].values())
    merged = load_file(target)
    assert all(torch.equal(merged[k], v) for k, v in runs["full"]["state"].items())


def test_inspect_understands_sharded_checkpoints(runs: dict[str, dict]) -> None:
    from gpukit.checkpoint._inspect import convert_checkpoint, inspect_checkpoint
    from gpukit.errors import ConfigurationError

    tmp = runs["dirs"]["tmp"]
    sharded = inspect_checkpoint(tmp / "full")["sharded"]  # what `gpukit ckpt inspect --json` prints
    assert (sharded["world_size"], sharded["shard_files"]) == (2, 2)
    assert sharded["objects"]["model"]["tensors"] == len(runs["full"]["state"])
    assert sharded["objects"]["optimizer"]["kind"] == "optimizer"
    with pytest.raises(ConfigurationError, match="sharded: model, optimizer"):
        convert_checkpoint(tmp / "full", tmp / "x.safetensors", select="nope")


def test_resume_into_another_model_is_one_grouped_error(runs: dict[str, dict]) -> None:
    tmp = runs["dirs"]["tmp"]
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", str(WORKER), str(tmp / "full"),
           str(tmp / "never-wider.pt"), "--wider"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and not (tmp / "never-wider.pt").exists()
    assert "CheckpointException" not in proc.stderr and "torch/distributed" not in proc.stderr, proc.stderr
    assert "Shape mismatch (state dict vs model):" in proc.stderr and "[12, 6] vs [16, 6]" in proc.stderr
    assert "rank 0's error lists the differences" in proc.stderr  # rank 1 points to it instead of repeating it
    assert proc.stderr.count("Shape mismatch") <= 2  # rank 0's own traceback and the launcher's summary


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.requires_gpu),  # NCCL at world size 1
                                  pytest.param(2, marks=pytest.mark.requires_gpus(2))])
def test_sharded_resume_on_gpus_with_nccl(tmp_path: Path, gpus: int) -> None:
    def run(*args: str, expect_kill: bool = False) -> None:
        cmd = [sys.executable, "-m", "gpukit", "run", "--gpus", str(gpus), str(WORKER), *args]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        assert (proc.returncode != 0) if expect_kill else (proc.returncode == 0), proc.stderr[-3000:]

    run(str(tmp_path / "full"), str(tmp_path / "full.pt"))
    run(str(tmp_path / "ck"), str(tmp_path / "never.pt"), "--save", "3", "--kill-after", "4", expect_kill=True)
    run(str(tmp_path / "ck"), str(tmp_path / "res.pt"))
    full, res = (torch.load(tmp_path / f"{n}.pt", map_location="cpu", weights_only=False) for n in ("full", "res"))
    assert res["start"] == 3
    for key, value in full["state"].items():
        assert torch.equal(res["state"][key], value), key
