"""What a new user meets first: one-line errors, tables that fit 80 columns, no tracebacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cli_helpers import run_gpukit as _gpukit
from gpukit.cli.run import run
from gpukit.devices import _nvml, claim_gpus

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setattr(_nvml, "_notice_given", False)
    _nvml.shutdown()


@pytest.mark.parametrize("args", [
    ["select", "--format", "json"], ["select", "-n", "0"], ["demo", "--epochs", "0"], ["bogus"],
    ["run", "--nproc", "two", "x.py"],
])
def test_usage_errors_are_one_gpukit_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _gpukit(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("gpukit: error: ") and err.count("\n") == 1 and "--help" in err, err


@pytest.mark.parametrize(("width", "spec"), [(80, "shared-4gpu"), (80, "mig-a100"), (100, "lost-gpu"), (60, "idle-8gpu")])
def test_ls_fits_the_terminal_and_never_wraps_names(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                     width: int, spec: str) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / f"{spec}.json"))
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, _ = _gpukit(capsys, "ls")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= width, out
    if spec == "shared-4gpu":
        assert out.count("NVIDIA TITAN X (Pascal)") == 4 and "GPU memory" in out


def test_ls_shows_claims_at_80_columns(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "shared-4gpu.json"))
    monkeypatch.setenv("COLUMNS", "80")
    with claim_gpus(gpus=[1], share=True):
        _, out, _ = _gpukit(capsys, "ls")
    assert "Claimed by" in out and f"pid {os.getpid()}" in out


@pytest.mark.usefixtures("ctrl_c_as_from_a_terminal")
def test_ls_watch_piped_prints_one_table_after_another() -> None:
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json")}
    env.pop("TTY_COMPATIBLE", None)
    proc = subprocess.Popen([sys.executable, "-c", "from gpukit.cli import main; main()", "ls", "--watch", "0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    headers, deadline = 0, time.monotonic() + 60
    while headers < 2 and time.monotonic() < deadline:
        headers += proc.stdout.readline().startswith("4 GPUs")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert headers == 2 and proc.returncode == 0 and "Traceback" not in err


def _run_params(*args: str) -> dict:
    with run.make_context("run", list(args)) as ctx:
        return dict(ctx.params)


def test_run_unknown_option_is_not_taken_for_the_script() -> None:
    result = CliRunner().invoke(run, ["--cpu", "--nprocs", "2", "train.py"])
    assert result.exit_code == 2 and "No such option '--nprocs'" in result.output and "--nproc" in result.output


def test_run_wait_with_a_unit_is_refused() -> None:
    result = CliRunner().invoke(run, ["--wait", "10m", "train.py"])
    assert result.exit_code == 2 and "'10m' is not a number of seconds" in result.output


def test_run_module_and_script_arguments_stay_theirs() -> None:
    params = _run_params("--cpu", "-m", "pkg.train", "--cpu", "--bogus")
    assert params["module"] == "pkg.train" and params["command"] == ("--cpu", "--bogus")
    params = _run_params("--nproc=2", "train.py", "--bogus")
    assert params["nproc"] == 2 and params["command"] == ("train.py", "--bogus")


def test_run_gpus_zero_and_bad_size_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _gpukit(capsys, "run", "--gpus", "0", "x.py")
    assert code == 2 and "--gpus '0'" in err and "--cpu" in err
    code, _, err = _gpukit(capsys, "run", "--gpus", "1", "--min-free", "8 gigs", "x.py")
    assert code == 2 and err.startswith("gpukit: error: --min-free: Invalid size '8 gigs'")


def test_plan_factory_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    name = f"gpukit_usability_models_{abs(hash(tmp_path))}"
    (tmp_path / f"{name}.py").write_text("def broken():\n    raise RuntimeError('boom')\n\n"
                                         "def needs(n):\n    return n\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, _, err = _gpukit(capsys, "plan", f"{name}:broken", "--batch-shape", "2,3")
    assert code == 2 and "broken() raised RuntimeError: boom at" in err and "Traceback" not in err
    code, _, err = _gpukit(capsys, "plan", f"{name}:needs", "--batch-shape", "2,3")
    assert code == 2 and "missing 1 required positional argument" in err
    code, _, err = _gpukit(capsys, "plan", f"{name}:broken", "--batch-shape", "2,3", "--device", "tpu")
    assert code == 2 and "--device 'tpu'" in err
    code, _, err = _gpukit(capsys, "plan", f"{name}:broken", "--batch-shape", "2,3", "--precision", "fp16")
    assert code == 2 and "--precision 'fp16'" in err and "16-mixed" in err


def test_convert_unsafe_names_the_trust_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(torch.nn.Linear(2, 2), tmp_path / "whole.pt")  # a pickled module
    code, _, err = _gpukit(capsys, "ckpt", "convert", str(tmp_path / "whole.pt"), str(tmp_path / "out.pt"))
    assert code == 2 and "--trust" in err
    code, out, _ = _gpukit(capsys, "ckpt", "inspect", str(tmp_path / "whole.pt"))
    assert code == 0 and "gpukit ckpt convert --trust" in out
