"""FLOP counting and MFU arithmetic: checked options, the dtype that runs, the peak chosen, exact counts."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from gpukit.errors import ConfigurationError
from gpukit.monitor import (
    FlopWindow, PeakChoice, check_flops_per_step, check_peak_tflops, format_flops, matmul_dtype, mfu_figures,
    resolve_peak, tf32_matmuls_on,
)


@pytest.mark.parametrize(("bad", "said"), [
    ("fast", "positive number"), (0, "positive number"), (-5.0, "positive number"), (math.nan, "positive number"),
    (math.inf, "positive number"), (True, "positive number"), (989.4e12, "did you mean peak_tflops=989.4"),
])
def test_bad_peak_tflops_are_clear_errors(bad: object, said: str) -> None:
    with pytest.raises(ConfigurationError, match="Session\\(peak_tflops=") as caught:
        check_peak_tflops(bad)
    assert said in str(caught.value)


def test_good_options_pass_through() -> None:
    assert check_peak_tflops(None) is None and check_peak_tflops(989.4) == 989.4 and check_peak_tflops(2) == 2.0
    assert check_flops_per_step(None) is None and check_flops_per_step(6e9) == 6_000_000_000


@pytest.mark.parametrize("bad", [0, -3, 1.5, "many", math.inf, False])
def test_bad_flops_per_step_are_clear_errors(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="flops_per_step=.*positive whole number"):
        check_flops_per_step(bad)


def test_the_dtype_is_the_precision_that_runs() -> None:
    assert matmul_dtype("bf16-mixed", tf32=True) == "bf16" and matmul_dtype("bf16-true", tf32=False) == "bf16"
    assert matmul_dtype("16-mixed", tf32=True) == "fp16" and matmul_dtype("16-true", tf32=False) == "fp16"
    assert matmul_dtype("32-true", tf32=True) == "tf32" and matmul_dtype("32-true", tf32=False) == "fp32"


def test_tf32_follows_torchs_matmul_precision() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not tf32_matmuls_on()
        torch.set_float32_matmul_precision("high")
        assert tf32_matmuls_on()
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_peak_given_wins_then_the_table_then_not_known() -> None:
    assert resolve_peak(100.0, "NVIDIA H100 80GB HBM3", "bf16") == PeakChoice(100.0, "bf16", "given: Session(peak_tflops=...)")
    table = resolve_peak(None, "NVIDIA H100 80GB HBM3", "bf16")
    assert table.tflops == 989.4 and table.source == "data sheet: H100 SXM bf16 dense"
    assert resolve_peak(None, "NVIDIA H100 80GB HBM3", "tf32").tflops == 494.7  # 32-true with TF32 on
    unknown = resolve_peak(None, None, "fp32")
    assert unknown.tflops is None and "Session(peak_tflops=...)" in unknown.source


def test_mfu_is_achieved_over_peak() -> None:
    figures = mfu_figures(10**12, steps=50, seconds=0.5, peak=PeakChoice(200.0, "bf16", "given"))
    assert figures is not None and figures.achieved_tflops == 100.0 and figures.mfu == 0.5
    assert figures.text() == "100 TFLOP/s, MFU 50% of 200 TFLOP/s (given)"
    unknown = mfu_figures(10**9, steps=3, seconds=1.0, peak=PeakChoice(None, "fp32", "no fp32 peak known"))
    assert unknown is not None and unknown.mfu is None and unknown.text().startswith("3 GFLOP/s achieved (MFU not known")
    assert mfu_figures(10**9, steps=0, seconds=1.0, peak=unknown.peak) is None
    assert format_flops(412.3) == "412.3 TFLOP/s" and format_flops(0.0000021) == "2.1 MFLOP/s"


def linear_stack_flops(batch: int, widths: list[int]) -> int:
    """Forward 2*B*i*o per layer; backward 2*B*i*o for each weight gradient and 2*B*i*o for each
    input gradient -- except the first layer's, whose input needs none (6*N*B less that term)."""
    pairs = list(zip(widths, widths[1:]))
    forward = sum(2 * batch * i * o for i, o in pairs)
    return forward + forward + sum(2 * batch * i * o for i, o in pairs[1:])


def test_the_window_counts_a_linear_stack_exactly() -> None:
    widths, batch = [32, 64, 48, 8], 16
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))
    x = torch.randn(batch, 32)
    window = FlopWindow()
    window.open()
    window.open()  # a second open while counting changes nothing
    model(x).square().mean().backward()
    counted = window.close()
    with FlopCounterMode(display=False) as reference:
        model(x).square().mean().backward()
    assert counted == reference.get_total_flops() == linear_stack_flops(batch, widths)
    assert window.close() == 0 and not window.is_open
