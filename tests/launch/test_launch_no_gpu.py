"""A GPU request on a machine without GPUs names its way out (issue 41.16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.errors import ConfigurationError, GpuSelectionError
from gpukit.launch import LaunchSpec
from gpukit.launch._gpus import plan_devices


@pytest.fixture
def no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "none.json"
    spec.write_text(json.dumps({"driver_version": "535.104.05", "gpus": []}))
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(spec))
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path))


def test_gpus_on_a_machine_without_any_names_cpu_and_nproc(no_gpus: None) -> None:
    with pytest.raises(GpuSelectionError, match=r"no NVIDIA GPU\. .*gpukit run --cpu --nproc 2"):
        plan_devices(LaunchSpec(gpus=2))


def test_cpu_with_gpus_is_refused_where_the_spec_is_made() -> None:
    with pytest.raises(ConfigurationError, match="--cpu and --gpus 2 contradict"):
        LaunchSpec(cpu=True, gpus=2)


def test_fake_gpus_say_the_workers_train_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41.16: with fake GPUs `gpukit run` printed an A100 mapping and trained on the CPU without saying so."""
    spec = Path(__file__).parents[2] / "examples" / "fake-gpus" / "idle-8gpu.json"
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(spec))
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path))
    plan = plan_devices(LaunchSpec(gpus=2))
    try:
        assert "cuda:1 -> GPU 1 NVIDIA A100" in plan.mapping
        assert f"these GPUs are fake (GPUKIT_FAKE_GPUS={spec})" in plan.mapping
        assert "without a real GPU here they train on the CPU (gloo)" in plan.mapping
    finally:
        plan.release()
