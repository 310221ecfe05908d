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
from gpukit.doctor._gpu_floors import copy_floor_gbps, matmul_reference, memory_reference_gbps
from gpukit.doctor._gpu_probe import (
    measure_allocatable, measure_allreduce, measure_copies, measure_device_memory, measure_matmul,
)
from gpukit.doctor._gpu_verdicts import (
    judge_allreduce, judge_copies, judge_device_memory, judge_errors, judge_gpu, judge_link, judge_matmul, judge_memory,
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


def test_copies_are_judged_by_their_sustained_minimum_against_48_gbps_on_gen5_x16() -> None:
    gen5 = _health(pcie_max_gen=5, pcie_max_width=16)
    assert copy_floor_gbps(gen5.link_peak_gbps()) == pytest.approx(48.0, abs=0.1)
    assert copy_floor_gbps(_health(pcie_max_gen=4, pcie_max_width=16).link_peak_gbps()) == pytest.approx(24.0, abs=0.1)
    healthy = {**_copies(55.0), "h2d_pinned_min_gbps": 54.0, "d2h_pinned_min_gbps": 53.5}
    assert judge_copies("GPU 0", "c", gen5, healthy).status == "ok"
    # a good median and a dip in one direction: the dip is what counts, and the message says which floor
    dipped = judge_copies("GPU 0", "c", gen5, {**healthy, "d2h_pinned_min_gbps": 41.0})
    assert dipped.status == "warn" and dipped.details["failed_floor"] == "copy_floor_gbps"
    assert "below the floor of 48.0 GB/s for PCIe gen5 x16" in dipped.message
    assert "device->host sustained minimum 41.0 GB/s" in dipped.message and "host->device sustained" not in dipped.message


def test_a_slow_matrix_product_names_the_throttle_reason_and_clock() -> None:
    matmul = {"n": 8192, "dtype": "bfloat16", "reps": 10, "tflops": 120.0,
              "during": {"clock_event_reasons": ["sw_power_cap", "gpu_idle"], "sm_clock_mhz": 1095,
                         "sm_max_clock_mhz": 1410}}
    finding = judge_matmul("GPU 3", "gpu3.matmul", A100, matmul)
    assert finding.status == "warn" and finding.details["failed_floor"] == "matmul_floor_tflops"
    assert "38% of its 312 TFLOP/s peak: below the floor of 199 TFLOP/s (85% of the reference assumed: 75% of the " \
           "312 TFLOP/s data sheet: A100 bf16 dense): throttled for power (software power cap); SM clock 1095 of " \
           "1410 MHz" in finding.message
    healthy = judge_matmul("GPU 3", "gpu3.matmul", A100, {**matmul, "tflops": 250.0})
    assert healthy.status == "ok" and "80% of" in healthy.message
    # the same mean with a window that sagged under the floor: judged by the sustained minimum
    sagged = judge_matmul("GPU 3", "gpu3.matmul", A100, {**matmul, "tflops": 250.0, "tflops_min": 150.0})
    assert sagged.status == "warn" and "sustained minimum 150" in sagged.message
    unknown = judge_matmul("GPU 3", "gpu3.matmul", "Some Future GPU", matmul)
    assert unknown.status == "info" and "no data-sheet peak" in unknown.message


def test_matmul_references_are_measured_where_known_and_assumed_elsewhere() -> None:
    h100 = matmul_reference("NVIDIA H100 80GB HBM3", "bf16")
    assert h100 is not None and h100[0] == 750.0 and h100[1].startswith("measured reference")
    assert matmul_reference("NVIDIA H200", "bf16")[0] == 750.0
    assumed = matmul_reference("NVIDIA L4", "bf16")
    assert assumed is not None and assumed[0] == pytest.approx(0.75 * 121.0) and assumed[1].startswith("reference assumed")
    assert matmul_reference("Some Future GPU", "bf16") is None
    ok = judge_matmul("GPU 0", "m", "NVIDIA H100 80GB HBM3",
                      {"n": 8192, "dtype": "bfloat16", "reps": 50, "tflops": 698.0, "tflops_min": 690.0})
    assert ok.status == "ok" and ok.details["floor_tflops"] == pytest.approx(637.5)  # 698 measured on the first lent H100


def test_device_memory_bandwidth_against_75_percent_of_the_data_sheet() -> None:
    assert memory_reference_gbps("NVIDIA H100 80GB HBM3") == 3350.0 and memory_reference_gbps("NVIDIA H200") == 4800.0
    assert memory_reference_gbps("NVIDIA A100 80GB PCIe") == 1935.0 and memory_reference_gbps("NVIDIA A100-SXM4-40GB") == 1555.0
    good = judge_device_memory("GPU 0", "gpu0.memory_bandwidth", "NVIDIA H200", {"gbps": 4100.0, "min_gbps": 4000.0})
    assert good.status == "ok" and "floor 3,600 GB/s (75%)" in good.message
    slow = judge_device_memory("GPU 0", "gpu0.memory_bandwidth", "NVIDIA H200", {"gbps": 4100.0, "min_gbps": 3000.0})
    assert slow.status == "warn" and "below the floor of 3,600 GB/s" in slow.message
    assert slow.details["failed_floor"] == "memory_floor_gbps"
    assert judge_device_memory("GPU 0", "m", "Some Future GPU", {"gbps": 1.0}).status == "info"
    assert judge_device_memory("GPU 0", "m", "NVIDIA H200", None).status == "info"


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
    assert [f.name for f in findings] == ["gpu2.pcie_link", "gpu2.copy_bandwidth", "gpu2.matmul",
                                          "gpu2.memory_bandwidth", "gpu2.memory", "gpu2.errors"]
    assert {f.status for f in findings} == {"ok", "info"} and findings[3].status == "info"  # memory not measured


def test_the_measurements_run_for_real_on_the_cpu() -> None:
    copies = measure_copies(torch.device("cpu"), 2**20, reps=2, during=lambda: "seen")
    assert copies["h2d_pinned_gbps"] > 0 and copies["h2d_pageable_gbps"] > 0 and copies["during"] == "seen"
    assert copies["h2d_pinned_min_gbps"] <= copies["h2d_pinned_gbps"] and copies["d2h_pinned_min_gbps"] > 0
    matmul = measure_matmul(torch.device("cpu"), torch.float32, n=64, seconds=0.01)
    assert matmul["tflops"] > 0 and matmul["reps"] >= 15 and matmul["dtype"] == "float32"
    assert 0 < matmul["tflops_min"] <= matmul["tflops"] * 1.0001
    memory = measure_device_memory(torch.device("cpu"), 4 * 2**20, reps=3)
    assert 0 < memory["min_gbps"] <= memory["gbps"]
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
