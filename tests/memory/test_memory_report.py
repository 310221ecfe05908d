"""memory_report / show_utilization / free_memory: the "see it" part."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from gpukit.devices import FakeNvml
from gpukit.errors import ConfigurationError
from gpukit.memory import free_memory, live_tensor_bytes, memory_report, show_utilization

FAKE_GPU = {"gpus": [{"name": "NVIDIA A100", "memory_total_mib": 40960, "memory_used_mib": 1024, "utilization_gpu_pct": 37}]}


def test_cpu_row_counts_live_tensor_bytes_once_per_storage() -> None:
    before = live_tensor_bytes("cpu")
    big = torch.zeros(256, 1024)  # 1 MiB
    views = [big[1:], big.view(-1), big.t()]  # share big's storage: must not count again
    after = live_tensor_bytes("cpu")
    assert after - before == big.numel() * 4
    row = memory_report("cpu")["cpu"]
    assert row.live_tensor_bytes is not None and row.live_tensor_bytes >= big.numel() * 4
    assert row.process_rss_bytes and row.process_rss_bytes > 0
    assert row.allocated_bytes is None  # no allocator counters on the CPU: None, not 0
    del views


def test_report_renders_as_text_rich_dict_and_json() -> None:
    report = memory_report()
    assert "cpu" in str(report) and "live tensors" in str(report)
    console = Console(record=True, width=160)
    console.print(report)
    assert "gpukit memory report" in console.export_text()
    as_dict = json.loads(report.to_json())
    assert as_dict == report.to_dict()
    assert as_dict["devices"][0]["device"] == "cpu"


def test_cuda_row_shows_nvml_numbers_without_initialising_cuda() -> None:
    with FakeNvml(FAKE_GPU):
        row = memory_report("cuda:0")["cuda:0"]
    assert row.name == "NVIDIA A100" and row.physical_index == 0
    assert row.nvml_total_bytes == 40960 * 2**20 and row.nvml_used_bytes == 1024 * 2**20
    if not torch.cuda.is_initialized():
        assert row.allocated_bytes is None and row.reserved_unused_bytes is None
        assert not torch.cuda.is_initialized()


def test_a_bare_cuda_is_gpu_0_and_the_cpu_row_has_no_nvml() -> None:
    with FakeNvml(FAKE_GPU):
        report = memory_report(["cuda", "cpu"])
    assert [row.device for row in report.devices] == ["cuda:0", "cpu"]
    assert report["cuda:0"].name == "NVIDIA A100" and report["cpu"].name is None
    assert report["cpu"].process_rss_bytes and report["cpu"].nvml_total_bytes is None


@pytest.mark.parametrize("bad", [object(), "tpu:0", True, "cuda:x"])
def test_bad_device_is_a_configuration_error(bad: object) -> None:
    with pytest.raises(ConfigurationError):
        memory_report(bad)  # type: ignore[arg-type]


def test_show_utilization_one_line_per_gpu_and_no_gpu_message() -> None:
    out = io.StringIO()
    spec = {"gpus": FAKE_GPU["gpus"] * 2}
    with FakeNvml(spec):
        text = show_utilization(file=out)
    assert out.getvalue().strip() == text
    lines = text.splitlines()
    assert len(lines) == 3 and "37%" in lines[1] and "1.00 GiB / 40.00 GiB" in lines[1]
    with FakeNvml({"no_driver": True, "gpus": []}):
        assert show_utilization(file=io.StringIO()).startswith("no GPU")


def test_free_memory_on_cpu_reports_none() -> None:
    assert free_memory("cpu") is None


@pytest.mark.requires_gpu
def test_free_memory_returns_cached_bytes_on_gpu() -> None:
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    assert (free_memory("cuda") or 0) >= 64 * 2**20
    row = memory_report("cuda:0")["cuda:0"]
    assert row.allocated_bytes is not None and row.reserved_unused_bytes is not None


def test_show_utilization_says_no_gpu_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpukit.devices import _nvml

    _nvml.shutdown()
    monkeypatch.setattr(_nvml, "_notice_given", False)
    try:
        with caplog.at_level("WARNING"), FakeNvml({"no_driver": True, "gpus": []}):
            text = show_utilization()
    finally:
        _nvml.shutdown()
    captured = capsys.readouterr()
    assert text.startswith("no GPU") and captured.out.strip() == text
    shown = captured.out + captured.err + "\n".join(r.getMessage() for r in caplog.records)
    assert shown.lower().count("nvidia") == 1, shown  # the notice is not repeated by the logger
