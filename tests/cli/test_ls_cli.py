"""`gpukit ls`: tables, --json, --watch, the no-driver message, and no torch import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.cli import main
from gpukit.devices import _nvml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setattr(_nvml, "_notice_given", False)
    _nvml.shutdown()


def _spec(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(EXAMPLES / f"{name}.json"))


def test_tables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "shared-4gpu")
    main(["ls"])
    out = capsys.readouterr().out
    assert "4 GPUs · driver 535.104.05" in out
    assert out.count("NVIDIA TITAN X (Pascal)") == 4 and "00000000:83:00.0" in out
    assert "10.7 / 11.9 GiB" in out and "97%" in out and "231/250 W" in out
    for cell in ("44683", "alice", "python train.py --lr 3e-4", "7.52 GiB", "carol"):
        assert cell in out


def test_mig_and_lost(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "mig-a100")
    main(["ls"])
    out = capsys.readouterr().out
    assert "(MIG)" in out and "MIG 3g.20gb" in out and "0:13" in out and "dave" in out
    _spec(monkeypatch, "lost-gpu")
    main(["ls"])
    assert "unusable: GPU is lost" in capsys.readouterr().out


def test_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "shared-4gpu")
    main(["ls", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["driver_version"] == "535.104.05" and data["notice"] is None
    g0 = data["gpus"][0]
    assert g0["memory_total_bytes"] == 12196 * 2**20 and g0["utilization_gpu_pct"] == 97
    assert g0["processes"][0] == {"pid": 44683, "user": "alice", "command": "python train.py --lr 3e-4",
                                  "used_memory_bytes": 7703 * 2**20}
    assert data["claims"] == [] and len(data["selectable"]) == 4


def test_claims_are_shown(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gpukit.devices import claim_gpus

    _spec(monkeypatch, "shared-4gpu")
    with claim_gpus(gpus=[1]) as claim:
        main(["ls", "--json"])
        data = json.loads(capsys.readouterr().out)
        assert data["claims"] == [{"uuid": claim.gpus[0].uuid, "pid": os.getpid()}]
        main(["ls"])
        assert f"pid {os.getpid()}" in capsys.readouterr().out


def test_no_driver_is_friendly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _spec(monkeypatch, "no-driver")
    main(["ls"])  # returns normally: exit status 0
    captured = capsys.readouterr()
    assert captured.out.startswith("No NVIDIA GPU/driver found (NVML Shared Library Not Found).")
    assert "GPUKIT_FAKE_GPUS=" in captured.out and captured.err == ""  # said once, not twice
    main(["ls", "--json"])
    assert json.loads(capsys.readouterr().out)["gpus"] == []


def test_bad_spec_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit) as info:
        main(["ls"])
    assert info.value.code == 2
    assert "gpukit: error: Fake-GPU spec" in capsys.readouterr().err


def _run(args: list[str], extra_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json"), **extra_env}
    return subprocess.Popen([sys.executable, "-c", "from gpukit.cli import main; main()", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("live", [False, True], ids=["json-lines", "rich-live"])
def test_watch_refreshes_until_ctrl_c(live: bool) -> None:
    # TTY_COMPATIBLE=1 makes rich treat the pipe as a terminal, so Live redraws in place
    proc = _run(["ls", "--watch", "0.1"] + ([] if live else ["--json"]), {"TTY_COMPATIBLE": "1"} if live else {})
    marker, per_frame = ("TITAN X", 4) if live else ('"gpus"', 1)
    seen, lines = 0, []
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while seen < 2 * per_frame and time.monotonic() < deadline:  # until two frames were drawn
        line = proc.stdout.readline()
        lines.append(line)
        seen += line.count(marker)
    assert seen >= 2 * per_frame, lines
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err  # Ctrl-C ends --watch successfully
    assert "Traceback" not in err


def test_ls_and_select_do_not_import_torch() -> None:
    script = (
        "import sys\nfrom gpukit.cli import main\n"
        "main(['ls']); main(['ls', '--json']); main(['select', '-n', '2'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(EXAMPLES / "shared-4gpu.json")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("2,1")
