from __future__ import annotations

import json

import pytest

from gpukit.monitor import Throughput, UtilizationSampler


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throughput_excludes_warmup_steps() -> None:
    clock = FakeClock()
    meter = Throughput(warmup_steps=2, clock=clock)
    meter.update(64)
    clock.now += 10.0  # a slow first step must not count
    meter.update(64)
    assert meter.samples_per_s is None
    for _ in range(4):
        clock.now += 0.5
        meter.update(32)
    assert meter.steps == 4
    assert meter.samples_per_s == pytest.approx(128 / 2.0)
    assert meter.steps_per_s == pytest.approx(2.0)


def test_throughput_rejects_negative_warmup() -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        Throughput(warmup_steps=-1)


def test_cpu_sampler_collects_samples_and_stops() -> None:
    sampler = UtilizationSampler(None, interval_s=10.0)
    assert sampler.source == "cpu"
    sum(i * i for i in range(200_000))  # some CPU work in the window
    sampler.sample_once()
    sampler.sample_once()
    summary = sampler.stop()
    assert summary.samples == 2
    assert summary.mean_pct is not None and summary.mean_pct >= 0


def test_gpu_sampler_reads_fake_nvml(tmp_path, monkeypatch) -> None:
    spec = {"gpus": [
        {"name": "GPU A", "memory_total_mib": 1000, "memory_used_mib": 10, "utilization_gpu_pct": 30},
        {"name": "GPU B", "memory_total_mib": 1000, "memory_used_mib": 10, "utilization_gpu_pct": 90},
        {"name": "GPU C", "memory_total_mib": 1000, "memory_used_mib": 10, "utilization_gpu_pct": 50},
    ]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(path))
    sampler = UtilizationSampler([0, 2], interval_s=10.0)
    sampler.sample_once()
    summary = sampler.stop()
    assert summary.source == "nvml"
    assert summary.mean_pct == pytest.approx(40.0)  # GPUs 0 and 2 only, not GPU 1
    assert summary.max_pct == pytest.approx(40.0)
