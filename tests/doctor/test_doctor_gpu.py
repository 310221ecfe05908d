"""`gpukit doctor --gpu`: the verdicts against the fake NVML's health facts, the measurements on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpukit.devices import FakeNvml
from gpukit.devices._health import GpuHealth, gpu_health
from gpukit.doctor._gpu_probe import measure_allocatable, measure_allreduce, measure_copies, measure_matmul
from gpukit.doctor._gpu_verdicts import (
    judge_allreduce, judge_copies, judge_errors, judge_gpu, judge_link, judge_matmul, judge_memory,
)

UNHEALTHY = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus" / "unhealthy-2gpu.json"
A100 = "NVIDIA A100-SXM4-40GB"


def _health(**fields: object) -> GpuHealth:
    return GpuHealth(index=0, **fields)  # type: ignore[arg-type]


def _copies(pinned: float, pageable: float = 8.0) -> dict:
    return {"h2d_pinned_gbps": pinned, "h2d_pageable_gbps": pageable, "d2h_pinned_gbps": pinned, "size_bytes": 1}


def test_health_is_read_from_the_fake_like_nvml_reports_it(isolated_nvml) -> None:
    with FakeNvml(UNHEALTHY):
        first, second = gpu_health(0), gpu_health(1)
    assert (first.pcie_gen, first.pcie_width, first.pcie_max_gen, first.pcie_max_width) == (3, 8, 4, 16)
    assert first.clock_event_reasons == ("sw_power_cap",) and first.sm_clock_mhz == 1095
    assert first.link_peak_gbps() == pytest.approx(31.5, abs=0.01)  # gen4 x16
    assert first.link_peak_gbps(current=True) == pytest.approx(7.88, abs=0.01)  # gen3 x8
    assert second.ecc_uncorrected_volatile == 3 and second.remapped_rows_pending is True
    with FakeNvml({"gpus": [{"name": "x", "memory_total_mib": 1, "memory_used_mib": 0}]}):
        bare = gpu_health(0)  # nothing in the spec: every field "Not Supported"
    assert bare.pcie_gen is None and bare.clock_event_reasons is None and bare.link_peak_gbps() is None


def test_a_link_trained_down_is_a_warning_with_the_fix() -> None:
    health = _health(pcie_gen=4, pcie_width=16, pcie_max_gen=4, pcie_max_width=16)
    # idle it reads gen4 x16; under load the probe saw gen3 x8
    finding = judge_link("GPU 0", "gpu0.pcie_link", health, {"pcie_gen": 3, "pcie_width": 8})
    assert finding.status == "warn" and "gen3 x8 under load, of PCIe gen4 x16" in finding.message
    assert "reseat" in finding.fix
    assert judge_link("GPU 0", "gpu0.pcie_link", health, {"pcie_gen": 4, "pcie_width": 16}).status == "ok"
    assert judge_link("GPU 0", "gpu0.pcie_link", _health(), None).status == "info"


def test_copy_bandwidth_is_judged_against_the_links_peak() -> None:
    health = _health(pcie_max_gen=4, pcie_max_width=16)  # 31.5 GB/s
    good = judge_copies("GPU 0", "gpu0.copy_bandwidth", health, _copies(25.0))
    assert good.status == "ok" and "79% of the PCIe gen4 x16 peak" in good.message
    slow = judge_copies("GPU 0", "gpu0.copy_bandwidth", health, _copies(10.0))
    assert slow.status == "warn" and "32% of" in slow.message and slow.details["share_of_peak"] == pytest.approx(10 / 31.504)
    assert judge_copies("GPU 0", "gpu0.copy_bandwidth", _health(), _copies(10.0)).status == "info"


def test_a_slow_matrix_product_names_the_throttle_reason_and_clock() -> None:
    matmul = {"n": 8192, "dtype": "bfloat16", "reps": 10, "tflops": 120.0,
              "during": {"clock_event_reasons": ["sw_power_cap", "gpu_idle"], "sm_clock_mhz": 1095,
                         "sm_max_clock_mhz": 1410}}
    finding = judge_matmul("GPU 3", "gpu3.matmul", A100, matmul)
    assert finding.status == "warn"
    assert "38% of its 312 TFLOP/s peak: throttled for power (software power cap); SM clock 1095 of 1410 MHz" in finding.message
    healthy = judge_matmul("GPU 3", "gpu3.matmul", A100, {**matmul, "tflops": 250.0})
    assert healthy.status == "ok" and "80% of" in healthy.message
    unknown = judge_matmul("GPU 3", "gpu3.matmul", "Some Future GPU", matmul)
    assert unknown.status == "info" and "no data-sheet peak" in unknown.message


def test_memory_is_not_filled_beside_other_processes_and_a_shortfall_warns() -> None:
    assert judge_memory("GPU 0", "gpu0.memory", {}, others=2).status == "info"
    gib = 2**30
    ok = judge_memory("GPU 0", "gpu0.memory", {"allocatable_bytes": 78 * gib, "free_bytes_at_allocation": 79 * gib}, 0)
    assert ok.status == "ok"
    short = judge_memory("GPU 0", "gpu0.memory", {"allocatable_bytes": 40 * gib, "free_bytes_at_allocation": 79 * gib}, 0)
    assert short.status == "warn" and "51%" in short.message


def test_memory_errors_from_the_fake_spec(isolated_nvml) -> None:
    with FakeNvml(UNHEALTHY):
        assert judge_errors("GPU 1", "gpu1.errors", gpu_health(1)).status == "fail"
        assert judge_errors("GPU 0", "gpu0.errors", gpu_health(0)).status == "ok"
    assert judge_errors("GPU 0", "e", _health(remapped_rows_failure=True)).status == "fail"
    pending = judge_errors("GPU 0", "e", _health(ecc_uncorrected_volatile=0, retired_pages_pending=True))
    assert pending.status == "warn" and "pages waiting to be retired" in pending.message
    assert judge_errors("GPU 0", "e", _health(ecc_uncorrected_volatile=0, ecc_uncorrected_aggregate=4)).status == "warn"
    assert judge_errors("GPU 0", "e", _health()).status == "info"


def test_judge_gpu_names_every_finding_after_its_gpu() -> None:
    probe = {"copies": {**_copies(25.0), "during": {"pcie_gen": 4, "pcie_width": 16}},
             "matmul": {"n": 8192, "dtype": "bfloat16", "reps": 10, "tflops": 250.0, "during": None},
             "allocatable_bytes": 39 * 2**30, "free_bytes_at_allocation": 39 * 2**30}
    health = _health(pcie_gen=4, pcie_width=16, pcie_max_gen=4, pcie_max_width=16, ecc_uncorrected_volatile=0)
    findings = judge_gpu("GPU 2", 2, A100, health, probe, others=0)
    assert [f.name for f in findings] == ["gpu2.pcie_link", "gpu2.copy_bandwidth", "gpu2.matmul", "gpu2.memory", "gpu2.errors"]
    assert {f.status for f in findings} == {"ok"}


def test_the_measurements_run_for_real_on_the_cpu() -> None:
    copies = measure_copies(torch.device("cpu"), 2**20, reps=2, during=lambda: "seen")
    assert copies["h2d_pinned_gbps"] > 0 and copies["h2d_pageable_gbps"] > 0 and copies["during"] == "seen"
    matmul = measure_matmul(torch.device("cpu"), torch.float32, n=64, seconds=0.01)
    assert matmul["tflops"] > 0 and matmul["reps"] >= 3 and matmul["dtype"] == "float32"
    assert measure_allocatable(torch.device("cpu"), 5 * 2**20, chunk_bytes=2**20) == 5 * 2**20


def test_allreduce_bus_bandwidth_over_two_real_gloo_processes() -> None:
    result = measure_allreduce(2, backend="gloo", device_type="cpu", size_bytes=2**20)
    assert result["world"] == 2 and result["busbw_gbps"] > 0
    slow = judge_allreduce({**result, "busbw_gbps": 1.0}, [_health(pcie_max_gen=4, pcie_max_width=16)] * 2)
    assert slow.status == "warn" and "under a quarter" in slow.message
    assert judge_allreduce(result, [_health()] * 2).status == "info"


def _doctor_gpu(env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("GPUKIT_FAKE_GPUS", "CUDA_VISIBLE_DEVICES")}
    return subprocess.run([sys.executable, "-m", "gpukit", "doctor", "--gpu", "--json"], capture_output=True, text=True,
                          env={**env, **env_extra}, timeout=120)


def test_cli_on_the_unhealthy_fake_judges_nvml_facts_and_exits_1(tmp_path: Path) -> None:
    proc = _doctor_gpu({"GPUKIT_FAKE_GPUS": str(UNHEALTHY), "GPUKIT_CLAIM_DIR": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    found = {f["name"]: f for f in json.loads(proc.stdout)["findings"]}
    assert found["gpu0.pcie_link"]["status"] == "warn" and found["gpu1.errors"]["status"] == "fail"
    assert "measuring nothing" in proc.stderr  # a fake GPU is never "measured"


def test_cli_without_a_gpu_says_so_and_exits_0(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    no_driver = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus" / "no-driver.json"
    proc = _doctor_gpu({"GPUKIT_FAKE_GPUS": str(no_driver), "GPUKIT_CLAIM_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    [active] = [f for f in json.loads(proc.stdout)["findings"] if f["name"] == "gpu.active"]
    assert active["status"] == "info" and active["message"].startswith("no NVIDIA GPU: nothing to measure")
