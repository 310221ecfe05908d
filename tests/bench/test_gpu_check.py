"""`make gpu-check` must run the day a GPU is lent: its plan on a CPU machine, every part on the CPU.

The lent GPU comes by chance, for 15 minutes; a typo in a part would waste it. So every part runs
here with ``--dry-run`` (the same code on the CPU, tiny sizes), and its results must be written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def _run(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES")}
    env["GPUKIT_CHECK_OUT"] = str(tmp_path / "out")
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=tmp_path)


def test_without_a_gpu_it_lists_the_plan_and_exits_0(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check would run")
    proc = _run(tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU: nothing to check" in proc.stdout
    for part in gpu_check.PARTS:
        assert f"  {part.name:<11} <= {part.limit_s:>3} s  {part.what}" in proc.stdout
    assert not (tmp_path / "out").exists()  # nothing written, nothing run


def test_bad_part_names_are_refused_with_the_list(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--only", "speed,sped", timeout=60)
    assert proc.returncode == 2 and "unknown part(s) sped; the parts are env, speed, mfu, syncs," in proc.stderr


# One test per part: the dry runs together take minutes, and one test per part lets pytest-xdist
# spread them over its processes instead of one process running them all at the end.
@pytest.mark.parametrize("part", [p.name for p in gpu_check.PARTS])
def test_every_part_runs_on_the_cpu_and_writes_its_results(tmp_path: Path, part: str) -> None:
    proc = _run(tmp_path, "--dry-run", "--budget-s", "900", "--only", part)
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    parts = {r["part"]: r for r in records if r["check"] == "(part)"}
    assert list(parts) == [part], proc.stdout[-3000:]
    assert parts[part]["status"] == "ok", (parts[part]["detail"], (out / "log.txt").read_text()[-6000:])
    failed = [r for r in records if r["status"] == "fail"]
    assert not failed, failed
    assert [r for r in records if r["part"] == part and r["check"] != "(part)"]  # the part said something
    assert (out / "results.md").read_text().count("\n") == len(records) + 2  # header + rule + a row each
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_the_table_survives_a_line_cut_off_by_a_kill(tmp_path: Path) -> None:
    good = {"part": "speed", "check": "P6 h2d pinned", "status": "info", "value": 51.2, "unit": "GB/s", "detail": "x|y"}
    (tmp_path / "results.jsonl").write_text(json.dumps(good) + "\n" + '{"part": "speed", "check": "P1')
    table = gpu_check.write_table(tmp_path)
    assert table.splitlines()[2] == "| speed | P6 h2d pinned | info | 51.2 GB/s |  | x/y |" and len(table.splitlines()) == 3


def test_a_goal_and_whether_it_was_met_are_in_the_table(tmp_path: Path) -> None:
    rows = [{"part": "speed", "check": "P1 mlp", "status": "warn", "value": 1.08, "unit": "x", "detail": "",
             "goal": "<= 1.01x plain", "met": False},
            {"part": "mfu", "check": "P7 auto", "status": "ok", "value": 41.0, "unit": "% MFU", "detail": "",
             "goal": ">= 40% MFU", "met": True}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = gpu_check.write_table(tmp_path).splitlines()
    assert lines[2] == "| speed | P1 mlp | warn | 1.08 x | <= 1.01x plain: MISSED |  |"
    assert lines[3] == "| mfu | P7 auto | ok | 41 % MFU | >= 40% MFU: met |  |"


def test_the_tests_part_keeps_each_result_when_it_is_killed_at_its_limit(tmp_path: Path) -> None:
    # The part's limit (180 s, or what the budget leaves) is shorter than the GPU tests may take: a
    # part killed mid-run must have written the results of the tests that ended before the kill.
    probe = tmp_path / "test_probe_gpu_part.py"
    probe.write_text("import time\nimport pytest\n\n\ndef test_probe_quick():\n    pass\n\n\n"
                     "def test_probe_skipped():\n    pytest.skip('not here')\n\n\n"
                     "def test_probe_hangs():\n    time.sleep(600)  # a hung test: the driver kills the part\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES")}
    out = tmp_path / "out"
    env["GPUKIT_CHECK_OUT"] = str(out)
    env["GPU_CHECK_PYTEST_ARGS"] = f"-m '' --deselect tests/ {probe}"  # only the probe's three tests
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_parts" / "tests.py")], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    results = out / "results.jsonl"
    try:
        deadline = time.monotonic() + 90  # collecting tests/ takes ~15 s; the probe hangs 150 s
        records: list[dict] = []
        while time.monotonic() < deadline and proc.poll() is None and len(records) < 2:
            time.sleep(0.2)  # polling the file the part writes, not standing in for a sync
            records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
        assert proc.poll() is None, "the part ended on its own: the probe's hanging test did not run"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # as gpu_check.py ends a part at its limit
        proc.wait()
    got = {r["check"].rsplit("::", 1)[-1]: r["status"] for r in records}
    assert got == {"test_probe_quick": "ok", "test_probe_skipped": "skip"}, records
