"""The one table of dense peak TFLOP/s: data-sheet dense figures only, matched on the device's own name."""

from __future__ import annotations

import pytest

from gpukit.devices import PEAK_DTYPES, dense_peak, peak_table

# The data sheets' dense figures (TFLOP/s), written out independently of the table: NVIDIA's
# H100/H200 SXM bf16 989.4 (the sheet's 1,979 is "with sparsity"), tf32 494.7 (989 sparse),
# fp8 1978.9 (3,958 sparse); H100 PCIe 756.5 bf16; A100 312 bf16 / 156 tf32 / 19.5 fp32 ...
KNOWN_DENSE = {
    ("NVIDIA H100 80GB HBM3", "bf16"): 989.4, ("NVIDIA H100 80GB HBM3", "tf32"): 494.7,
    ("NVIDIA H100 80GB HBM3", "fp8"): 1978.9, ("NVIDIA H100 80GB HBM3", "fp32"): 66.9,
    ("NVIDIA H100 PCIe", "bf16"): 756.5, ("NVIDIA H100 PCIe", "tf32"): 378.0, ("NVIDIA H100 NVL", "bf16"): 835.5,
    ("NVIDIA H200", "bf16"): 989.4, ("NVIDIA H200", "fp16"): 989.4, ("NVIDIA H200 NVL", "bf16"): 835.5,
    ("NVIDIA GH200 480GB", "bf16"): 989.4,
    ("NVIDIA A100-SXM4-80GB", "bf16"): 312.0, ("NVIDIA A100-SXM4-40GB", "tf32"): 156.0,
    ("NVIDIA A100-PCIE-40GB", "bf16"): 312.0, ("NVIDIA A100 80GB PCIe", "fp32"): 19.5,
    ("NVIDIA L40S", "bf16"): 362.05, ("NVIDIA L40S", "tf32"): 183.0, ("NVIDIA L40S", "fp8"): 733.0,
    ("NVIDIA L4", "bf16"): 121.0, ("NVIDIA L4", "fp8"): 242.5, ("NVIDIA A10", "bf16"): 125.0,
    ("NVIDIA A10", "tf32"): 62.5, ("NVIDIA GeForce RTX 4090", "bf16"): 165.2,
    ("NVIDIA GeForce RTX 3090", "fp16"): 71.0, ("Tesla V100-SXM2-16GB", "fp16"): 125.0,
    ("Tesla V100-PCIE-32GB", "fp16"): 112.0, ("Tesla T4", "fp16"): 65.0, ("NVIDIA A30", "bf16"): 165.0,
    ("NVIDIA A40", "bf16"): 149.7, ("NVIDIA RTX A6000", "bf16"): 154.8,
}
# the sparsity figures the same sheets print: none may appear anywhere in the table
SPARSE = {1979.0, 1978.8, 3958.0, 3957.8, 3026.0, 1671.0, 3341.0, 624.0, 1466.0, 485.0, 330.4,
          142.0, 309.7}


@pytest.mark.parametrize(("name", "dtype"), sorted(KNOWN_DENSE))
def test_the_table_holds_the_data_sheets_dense_figure(name: str, dtype: str) -> None:
    found = dense_peak(name, dtype)
    assert found is not None and found.tflops == KNOWN_DENSE[(name, dtype)] and found.dtype == dtype
    assert not found.estimated and found.source.startswith("data sheet: ")


def test_no_sparsity_figure_anywhere() -> None:
    for model, _, figures in peak_table():
        assert set(figures) <= set(PEAK_DTYPES), model
        for dtype, tflops in figures.items():
            assert all(abs(tflops - s) > 0.05 for s in SPARSE), (model, dtype, tflops)
        # dense ordering every data sheet keeps: fp8 = 2 x bf16, bf16 = 2 x tf32 on data-center tensor cores
        if "fp8" in figures and "bf16" in figures:
            assert figures["fp8"] == pytest.approx(2 * figures["bf16"], rel=0.02), model
        assert figures.get("tf32", 0) <= figures.get("bf16", figures.get("fp16", 0)), model


def test_names_match_on_word_boundaries_and_the_most_specific_row() -> None:
    assert dense_peak("NVIDIA A10G", "bf16") is None  # not an A10 (nor an A100)
    assert dense_peak("NVIDIA GeForce RTX 3090 Ti", "bf16") is None  # another card than the 3090
    assert dense_peak("NVIDIA L40", "bf16").tflops == 181.05  # not L4's, not L40S's
    assert dense_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert dense_peak(None, "bf16") is None and dense_peak("Some Future GPU", "bf16") is None
    family = dense_peak("NVIDIA H100", "bf16")
    assert family is not None and family.estimated and family.source.startswith("estimated: H100")


def test_an_unknown_dtype_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        dense_peak("NVIDIA H100 PCIe", "int8")
