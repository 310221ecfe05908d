"""`gpukit select`: prints only the choice (composes in shell), fails with exit 2 and a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukit.cli import main
from gpukit.devices import _nvml, claim_gpus

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "shared-4gpu.json"))
    monkeypatch.setattr(_nvml, "_notice_given", False)
    _nvml.shutdown()


def _select(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(["select", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("args", "stdout"),
    [
        ([], "2\n"),
        (["-n", "2", "--share"], "2,1\n"),
        (["--count", "2", "--format", "env", "--share"], "CUDA_VISIBLE_DEVICES=2,1\n"),
        (["-n", "1", "--format", "uuids"], "GPU-7c1d2e5a-3b4f-4a8c-8d9e-2f3a4b5c6d7e\n"),
        (["-n", "2", "--exclude", "2, GPU-6b0c", "--share"], "0,3\n"),
        (["-n", "2", "--min-free", "7000MiB", "--share"], "2,1\n"),
        (["-n", "2", "--max-util", "40", "--order", "index", "--share"], "1,2\n"),
        (["--max-procs", "0", "--wait"], "2\n"),  # --wait alone: met at once, no waiting
    ],
)
def test_prints_only_the_choice(args: list[str], stdout: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _select(args, capsys) == (0, stdout, "")


def test_unmet_request_exits_2_naming_each_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _select(["-n", "2", "--min-free", "8GiB"], capsys)
    assert (code, out) == (2, "")
    assert err.startswith("gpukit: error: Need 2 GPUs with free memory >= 8.00 GiB; 1 of 4 qualify:")
    assert "GPU 1 (NVIDIA TITAN X (Pascal)): free 7.50 GiB < required 8.00 GiB" in err


def test_wait_with_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _select(["-n", "2", "--min-free", "8GiB", "--wait", "0.2"], capsys)
    assert (code, out) == (2, "")
    assert "gpukit: waiting for 2 GPUs" in err and "Gave up after waiting" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-free", "8 GB of RAM"], "expected a byte count (e.g. 8589934592) or a number with a unit: 8GiB"),
        (["--wait", "soon"], "--wait 'soon' is not a number of seconds"),
        (["--exclude", "first"], "Cannot exclude 'first'"),
        (["-n", "0"], "Invalid value for '-n' / '--count'"),
        (["--format", "json"], "Invalid value for '--format'"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _select(args, capsys)
    assert code == 2 and out == "" and message in err


def test_skips_claimed_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    with claim_gpus(gpus=[2]):
        assert _select(["-n", "2", "--share"], capsys)[:2] == (0, "1,0\n")


def test_other_users_gpus_are_busy_unless_shared(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _select(["-n", "2"], capsys)
    assert (code, out) == (2, "")
    assert "GPU 1 (NVIDIA TITAN X (Pascal)): in use by bob's pid 51002 (jupyter-lab)" in err
    assert _select(["-n", "2", "--share"], capsys)[:2] == (0, "2,1\n")


def test_no_driver(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "no-driver.json"))
    code, out, err = _select(["--wait", "30"], capsys)
    assert (code, out) == (2, "")
    assert err.strip() == ("gpukit: error: Need 1 GPU but no NVIDIA GPU/driver found (NVML Shared Library Not "
                           "Found). Run on the CPU, or on a machine with GPUs.")


def test_mig_devices_by_uuid(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / "mig-a100.json"))
    code, out, _ = _select(["-n", "2", "--format", "env", "--share"], capsys)
    assert (code, out) == (0, "CUDA_VISIBLE_DEVICES=1,MIG-aa11bb22-cc33-5d44-9e55-ff6677889900\n")
