"""torch.compile kept under single, DDP and FSDP (inductor on the CPU), and Session(compile=...).

Each run compiles a tiny model with inductor in a fresh process (g++ builds the kernels: about
10-30 s per run on 2 busy cores) and reports dynamo's count of compiled graphs. Before the fix,
DDP and FSDP unwrapped the ``torch.compile`` wrapper and compiled 0 graphs, silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _compile_worker as worker  # noqa: E402

import gpukit  # noqa: E402
from gpukit.errors import ConfigurationError  # noqa: E402


def _run(out: Path, strategy: str, how: str, gpus: int = 0) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    script = [str(Path(worker.__file__)), str(out), strategy, how, *(["gpu"] if gpus else [])]
    where = ["--gpus", str(gpus)] if gpus else ["--cpu", "--nproc", "2"]
    cmd = [sys.executable, *script] if strategy == "single" else [
        sys.executable, "-m", "gpukit", "run", *where, *script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _check_portable(out: Path) -> None:
    """The checkpoint has the plain model's keys (no _orig_mod., no module.) and loads strictly."""
    state = gpukit.load(out / "export" / "model.safetensors")
    plain = worker.Tiny()
    assert sorted(state) == sorted(plain.state_dict())
    plain.load_state_dict(state, strict=True)


def test_user_compile_kept_on_one_device(tmp_path: Path) -> None:
    (record,) = _run(tmp_path, "single", "user")
    assert record["graphs"] >= 1 and record["returned"] == "Tiny"  # compiled in place, not a wrapper
    _check_portable(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "how", "returned"), [
    ("ddp", "user", "DistributedDataParallel"),  # torch.compile(model) before setup: the DDP wrapper compiled
    pytest.param("fsdp", "session", "FSDPTiny",  # Session(compile=True): each FSDP unit compiled
                 marks=pytest.mark.requires_cpu_fsdp),
])
def test_compile_kept_on_two_processes(tmp_path: Path, strategy: str, how: str, returned: str) -> None:
    records = _run(tmp_path, strategy, how)
    assert len(records) == 2
    for record in records:
        assert record["graphs"] >= 1 and record["returned"] == returned
    assert records[0]["losses"] != records[1]["losses"]  # each rank trained on its own batches
    _check_portable(tmp_path)


@pytest.mark.parametrize("gpus", [pytest.param(1, marks=pytest.mark.requires_gpu),  # NCCL at world size 1
                                  pytest.param(2, marks=pytest.mark.requires_gpus(2))])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_kept_on_gpus(tmp_path: Path, strategy: str, gpus: int) -> None:
    records = _run(tmp_path, strategy, "user", gpus=gpus)  # nccl; inductor's GPU (triton) kernels
    assert len(records) == gpus and all(r["graphs"] >= 1 for r in records)
    _check_portable(tmp_path)


def test_compile_settings_checked_and_strategies_that_cannot_say_so() -> None:
    with pytest.raises(ConfigurationError, match="unknown option.*bogus.*fullgraph"):
        gpukit.Session(accelerator="cpu", compile={"bogus": 1}, verbose=False)
    with pytest.raises(ConfigurationError, match="use True, False, or a dict"):
        gpukit.Session(accelerator="cpu", compile="yes", verbose=False)
    pipeline = gpukit.Session(strategy=gpukit.strategies.PipelineStrategy(["cpu", "cpu"], verbose=False),
                              compile=True, verbose=False)
    with pytest.raises(ConfigurationError, match="not supported with strategy='pipeline'"):
        pipeline.setup(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    # the user's own torch.compile under a strategy that cannot keep it: a warning, not silence
    pipeline = gpukit.Session(strategy=gpukit.strategies.PipelineStrategy(["cpu", "cpu"], verbose=False),
                              verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline.setup(torch.compile(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))))
    assert any("torch.compile(model) before session.setup is not kept" in str(w.message) for w in caught)
