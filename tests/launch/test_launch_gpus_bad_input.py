"""GPU claims on a fake 4-GPU box, and bad input: a clear message, non-zero exit, nothing left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import BEHAVE, gpukit_command, processes_with_marker

from gpukit.errors import ConfigurationError

pytestmark = pytest.mark.slow

SPEC = {
    "driver_version": "535.104.05",
    "gpus": [
        {"name": f"NVIDIA A100 #{i}", "uuid": f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}",
         "pci_bus_id": f"00000000:0{i + 1}:00.0", "memory_total_mib": 40960, "memory_used_mib": 0}
        for i in range(4)
    ],
}


@pytest.fixture
def fake_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    spec = tmp_path / "box.json"
    spec.write_text(json.dumps(SPEC))
    claims = tmp_path / "claims"
    claims.mkdir()
    env = {"GPUKIT_FAKE_GPUS": str(spec), "GPUKIT_CLAIM_DIR": str(claims)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _gpukit(*args: str, env: dict[str, str], marker: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(gpukit_command(*args), capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **env, "GPUKIT_TEST_MARKER": marker})


def test_gpus_are_claimed_for_the_run_and_bad_requests_fail_cleanly(fake_box, start_run, tmp_path):
    from gpukit.devices import claim_gpus
    from gpukit.errors import GpuSelectionError

    run = start_run("--gpus", "2", "--grace", "2", str(BEHAVE), "sleep", "{out}", env=fake_box)
    run.files("ready-0", "ready-1")
    out = run.output()
    assert "2 worker processes" in out  # --nproc defaults to the number of GPUs
    assert "cuda:0 -> GPU" in out and "cuda:1 -> GPU" in out
    ready = json.loads((run.out / "ready-0").read_text())
    visible = ready["CUDA_VISIBLE_DEVICES"]
    assert len(visible.split(",")) == 2 and ready["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    taken = [int(i) for i in visible.split(",")]

    # The claim lives as long as the run: the same GPUs cannot be taken meanwhile...
    with pytest.raises(GpuSelectionError):
        claim_gpus(gpus=taken)
    busy = _gpukit("run", "--gpus", f"{taken[0]},{taken[1]}", str(BEHAVE), "sleep", str(tmp_path),
                   env=fake_box, marker=run.marker + "-busy")
    assert busy.returncode == 2 and "gpukit: error:" in busy.stderr, busy.stderr
    # ... a count is served from the GPUs still free, never the taken ones.
    other = claim_gpus(2)
    assert not {g.index for g in other.gpus} & set(taken)
    other.release()

    for args, expected in [
        (("--gpus", "5"), "5"),
        (("--gpus", "1,9"), "9"),
        (("--gpus", "two"), "Invalid --gpus"),
    ]:
        bad = _gpukit("run", *args, str(BEHAVE), "sleep", str(tmp_path), env=fake_box, marker=run.marker + "-bad")
        assert bad.returncode == 2, (args, bad.stderr)
        assert "gpukit: error:" in bad.stderr and expected in bad.stderr, (args, bad.stderr)
        assert "Traceback" not in bad.stderr
    assert not processes_with_marker(run.marker + "-bad")
    assert not processes_with_marker(run.marker + "-busy")

    run.proc.terminate()
    assert run.wait() == 143
    claim_gpus(gpus=taken).release()  # released with the run


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--cpu", "does-not-exist.py"), "Script 'does-not-exist.py' not found"),
        (("--cpu", "--nproc", "0", str(BEHAVE)), "'--nproc': 0"),  # the CLI's range check (cli/_common.py)
        (("--cpu", "-m", "no_such_module_gpukit"), "Module 'no_such_module_gpukit' not found"),
        (("--nnodes", "2", "--cpu", str(BEHAVE)), "needs --master-addr"),
        (("--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", str(BEHAVE)), "out of range"),
    ],
)
def test_bad_arguments_give_one_clear_line(args, expected, tmp_path):
    marker = f"bad-{time.monotonic_ns()}"
    result = _gpukit("run", *args, env={}, marker=marker)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not processes_with_marker(marker)


def test_unreachable_master_fails_within_the_rendezvous_timeout(tmp_path):
    with socket.socket() as sock:  # a local port nobody listens on: no traffic leaves the machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    marker = f"unreachable-{time.monotonic_ns()}"
    started = time.monotonic()
    result = _gpukit("run", "--cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                     "--master-port", str(port), "--rdzv-timeout", "2", str(BEHAVE), "sleep", str(tmp_path),
                     env={}, marker=marker)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30
    assert f"Could not reach the rendezvous at 127.0.0.1:{port}" in result.stderr
    assert "--rdzv-timeout" in result.stderr
    assert not processes_with_marker(marker)
    assert not list(tmp_path.glob("ready-*"))  # no worker ever started


def test_several_mig_instances_for_one_run_are_refused(tmp_path, monkeypatch):
    from gpukit.launch import GpuRequest, LaunchSpec
    from gpukit.launch._gpus import plan_devices

    examples = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(examples / "mig-a100.json"))
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    with pytest.raises(ConfigurationError, match="only one MIG instance"):
        plan_devices(LaunchSpec(gpus=GpuRequest(count=2), nproc=2))
    plan = plan_devices(LaunchSpec(gpus=GpuRequest(count=1), nproc=1))  # one device (here the whole GPU, most free memory) is fine
    try:
        assert plan.gpu_count == 1
    finally:
        plan.release()
