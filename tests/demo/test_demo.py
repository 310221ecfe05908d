"""The built-in example: it must learn, save a portable checkpoint, and run as DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import gpukit
from gpukit.demo import DemoConfig, DigitsCNN, load_digits_split, run_demo
from gpukit.errors import ConfigurationError


def test_digits_split_is_deterministic_and_disjoint() -> None:
    train_a, test_a = load_digits_split(seed=0)
    train_b, test_b = load_digits_split(seed=0)
    assert torch.equal(train_a.tensors[0], train_b.tensors[0])
    assert len(train_a) + len(test_a) == 1797
    assert train_a.tensors[0].shape[1:] == (1, 8, 8)
    assert 0.0 <= float(train_a.tensors[0].min()) and float(train_a.tensors[0].max()) <= 1.0
    _, test_other = load_digits_split(seed=1)
    assert not torch.equal(test_a.tensors[1], test_other.tensors[1])


def test_demo_learns_and_checkpoint_loads_into_plain_model(tmp_path) -> None:
    result = run_demo(DemoConfig(epochs=3, out_dir=str(tmp_path)), cpu=True)
    assert result.test_accuracy >= 0.95
    assert result.reloaded_accuracy == result.test_accuracy
    assert result.world_size == 1 and result.device == "cpu"
    assert result.samples_per_s is not None and result.samples_per_s > 0

    # The checkpoint is portable: plain keys, CPU tensors, loads with weights_only.
    state = gpukit.load(tmp_path / "digits-cnn.pt", map_location="cpu")
    keys = list(state["model"])
    assert keys and not any(k.startswith(("module.", "_orig_mod.")) for k in keys)
    DigitsCNN().load_state_dict(state["model"])  # plain torch accepts it too


@pytest.mark.parametrize("field,value", [("epochs", 0), ("batch_size", -1), ("learning_rate", 0.0)])
def test_demo_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=field):
        DemoConfig(**{field: value})


@pytest.mark.slow
def test_demo_cli_runs_two_process_ddp_on_cpu(tmp_path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    proc = subprocess.run(
        [sys.executable, "-m", "gpukit", "demo", "--nproc", "2", "--cpu", "--epochs", "2",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x 2 processes, strategy ddp" in proc.stdout
    assert "(identical)" in proc.stdout
    assert (tmp_path / "digits-cnn.pt").is_file()
    # the run was recorded by both ranks and its report written
    report = tmp_path / "record" / "report.html"
    assert f"report: {report}" in proc.stdout.replace("\n", "") and report.is_file()
    from gpukit.report import read_record, summarize

    summary = summarize(read_record(tmp_path / "record"))
    assert summary.finished and sorted(r.rank for r in summary.ranks) == [0, 1]
    assert all(r.steps > 0 for r in summary.ranks) and summary.time_split_pct
    assert 'class="series" d="M' in report.read_text()


def test_demo_cli_rejects_zero_processes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpukit", "demo", "--nproc", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "Invalid value for '--nproc': 0" in proc.stderr and "gpukit demo --help" in proc.stderr
