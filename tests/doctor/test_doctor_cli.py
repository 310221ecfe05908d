"""`gpukit doctor`: one line per finding with its fix, the report, --json, exit codes, no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.doctor import CHECKS, run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import run_gpukit  # noqa: E402


def test_json_parses_and_has_every_check(capsys):
    code, out, _ = run_gpukit(capsys, "doctor", "--json")
    data = json.loads(out)
    names = [f["name"] for f in data["findings"]]
    for check, _ in CHECKS:  # one finding at least per check ("network.interface.gloo" for its own variable)
        assert any(name == check or name.startswith(check + ".") for name in names), check
    assert {"status", "message", "fix", "details"} <= set(data["findings"][0])
    assert {"versions", "gpus", "cpus", "shm", "network", "environment"} <= set(data["report"])
    assert code == (1 if any(f["status"] == "fail" for f in data["findings"]) else 0)


def test_clean_machine_exits_0_and_a_failed_check_exits_1(capsys, use_spec, monkeypatch, tmp_path):
    use_spec("shared-4gpu")
    monkeypatch.setenv("GPUKIT_SHM_PATH", str(tmp_path))
    code, out, _ = run_gpukit(capsys, "doctor")
    assert code == 0, out
    assert "--- report (paste into a bug report) ---" in out and "GPU 3: NVIDIA TITAN X (Pascal)" in out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,7")
    code, out, _ = run_gpukit(capsys, "doctor")
    assert code == 1
    [line] = [ln for ln in out.splitlines() if "cuda.visible_devices" in ln]
    assert line.startswith("FAIL") and "-> fix: use physical indices" in line  # finding and fix on one line
    assert "CUDA_VISIBLE_DEVICES=0,7" in out  # in the report's environment section


def test_report_leaves_out_unrelated_environment(capsys, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    code, out, _ = run_gpukit(capsys, "doctor", "--json")
    env = json.loads(out)["report"]["environment"]
    assert env.get("NCCL_DEBUG") == "INFO" and "AWS_SECRET_ACCESS_KEY" not in env


def test_bad_fake_spec_is_one_error_line_and_exit_2(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(bad))
    code, _, err = run_gpukit(capsys, "doctor")
    assert code == 2 and err.startswith("gpukit: error:") and "not valid JSON" in err


def test_a_crashing_check_becomes_a_finding(monkeypatch):
    from gpukit.doctor import _run

    def broken(ctx):
        raise OSError("boom")

    monkeypatch.setattr(_run, "CHECKS", (("system.shm", broken),))
    [finding] = run_checks().findings
    assert finding.status == "warn" and "OSError: boom" in finding.message


@pytest.mark.slow
def test_fresh_process_does_not_import_torch_and_is_fast(tmp_path):
    code = ("import sys, time; t = time.perf_counter(); from gpukit.cli import main\n"
            "try:\n    main(['doctor', '--json'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules, time.perf_counter() - t)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    wall_s = time.perf_counter() - start
    marker = done.stdout.strip().splitlines()[-1].split()
    assert marker[:2] == ["TORCH", "False"], done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[0])["report"]["torch_imported"] is False
    assert wall_s < 10, f"gpukit doctor took {wall_s:.1f} s"
