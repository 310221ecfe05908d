"""`gpukit run --wait` waits in the fair queue: `gpukit ls` shows it with its run id, it starts when a GPU frees up;
`--share` takes a GPU another user's process uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.devices import claim_gpus

SPEC = {"driver_version": "535.104.05", "gpus": [
    {"name": f"NVIDIA A100 #{i}", "uuid": f"GPU-{i}{i}{i}{i}bbbb-0000-0000-0000-00000000000{i}",
     "memory_total_mib": 40960, "memory_used_mib": 0,
     "processes": [{"pid": 7, "user": "someone-else", "command": "python theirs.py"}] if i == 1 else []}
    for i in range(2)]}


@pytest.fixture
def box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps(SPEC))
    env = {"GPUKIT_FAKE_GPUS": str(spec), "GPUKIT_CLAIM_DIR": str(tmp_path / "claims")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _ls_json(capsys: pytest.CaptureFixture[str]) -> dict:
    from gpukit.cli import main

    main(["ls", "--json"])
    return json.loads(capsys.readouterr().out)


def test_run_waits_in_the_queue_and_ls_shows_it(box, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os; print('ran on', os.environ['CUDA_VISIBLE_DEVICES'])\n")
    with claim_gpus(gpus=[0]) as held:  # GPU 1 is another user's: busy too (no --share)
        proc = subprocess.Popen([sys.executable, "-m", "gpukit", "run", "--gpus", "1", "--wait", "120", str(script)],
                                env={**os.environ, **box}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline, queue = time.monotonic() + 60, []
            while not queue and time.monotonic() < deadline and proc.poll() is None:
                queue = _ls_json(capsys)["queue"]
                time.sleep(0.05)
            assert queue, proc.communicate(timeout=10)
            [waiting] = queue
            assert waiting["pid"] == proc.pid and waiting["gpus_wanted"] == 1
            assert waiting["run"].startswith("gpukit-") and waiting["user"]
        finally:
            held.release()  # GPU 0 frees up: the waiting run takes it
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "ran on 0" in out
    assert _ls_json(capsys)["queue"] == []


def test_share_takes_a_gpu_another_users_process_uses(box, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os; print('ran on', os.environ['CUDA_VISIBLE_DEVICES'])\n")
    env = {**os.environ, **box}
    refused = subprocess.run([sys.executable, "-m", "gpukit", "run", "--gpus", "1,", str(script)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "in use by someone-else's pid 7 (python theirs.py)" in refused.stderr
    shared = subprocess.run([sys.executable, "-m", "gpukit", "run", "--gpus", "1,", "--share", str(script)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert shared.returncode == 0 and "ran on 1" in shared.stdout, shared.stderr
