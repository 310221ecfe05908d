"""Data-sheet DENSE peak TFLOP/s per GPU model and dtype: the one table MFU, `doctor --gpu` and the benches read.

Every figure is the vendor data sheet's dense figure: never the 2:4 structured-sparsity one that
the same sheets print beside it (marked ``*``, twice as large: 1,979 instead of 989 TFLOP/s bf16
on an H100 SXM). Tensor-core figures are those with fp32 accumulation (what ``torch.matmul`` and
autocast run: GeForce cards do twice as much with fp16 accumulation, which PyTorch does not use).
``fp32`` is the plain (CUDA-core) rate, what fp32 matmuls reach with TF32 off; ``tf32`` the
tensor-core rate with TF32 on. A dtype the GPU has no tensor cores for is left out (V100: no bf16,
no tf32), and so is a figure the data sheet does not state plainly.

Rows are matched against the NVML / CUDA device name, lower case, most specific first (``h100
pcie`` before ``h100``), on word boundaries (``a10`` does not match ``a100`` or ``a10g``). A row
marked as a family fallback (the name says the model but not its form factor) is ``estimated``.
No torch here: `devices/` must stay importable before CUDA is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PEAK_DTYPES", "DensePeak", "dense_peak", "memory_bandwidth_gbps", "peak_table"]

#: the dtypes the table has figures for
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

# the SXM Hopper figures, shared by H100 SXM, H800, H200 and GH200
_HOPPER_SXM = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
_HOPPER_PCIE = {"fp32": 51.2, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0}
_A100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}  # SXM4 and PCIe, 40 and 80 GB alike

# (pattern on the lower-case name, the model's name, a family fallback?, dense TFLOP/s per dtype)
_ROWS: tuple[tuple[str, str, bool, dict[str, float]], ...] = (
    (r"\bb200\b", "B200 (HGX)", False, {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    (r"\bgh200\b", "GH200", False, _HOPPER_SXM),
    (r"\bh200 nvl\b", "H200 NVL", False, _HOPPER_NVL),
    (r"\bh200\b", "H200 SXM", False, _HOPPER_SXM),
    (r"\bh100 nvl\b", "H100 NVL", False, _HOPPER_NVL),
    (r"\bh100 pcie\b", "H100 PCIe", False, _HOPPER_PCIE),
    (r"\bh100\b.*\b(sxm|hbm3)", "H100 SXM", False, _HOPPER_SXM),
    (r"\bh100\b", "H100 (form factor not in the name: SXM assumed)", True, _HOPPER_SXM),
    (r"\bh800 pcie\b", "H800 PCIe", False, _HOPPER_PCIE),
    (r"\bh800\b", "H800 SXM", False, _HOPPER_SXM),
    (r"\ba100\b", "A100", False, _A100),
    (r"\ba800\b", "A800", False, _A100),
    (r"\ba30\b", "A30", False, {"fp32": 10.3, "tf32": 82.0, "bf16": 165.0, "fp16": 165.0}),
    (r"\ba40\b", "A40", False, {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7}),
    (r"\ba10\b", "A10", False, {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    (r"\brtx a6000\b", "RTX A6000", False, {"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8}),
    (r"\bl40s\b", "L40S", False, {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0}),
    (r"\bl40\b", "L40", False, {"fp32": 90.5, "tf32": 90.5, "bf16": 181.05, "fp16": 181.05, "fp8": 362.1}),
    (r"\bl4\b", "L4", False, {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5}),
    (r"\brtx 4090\b", "GeForce RTX 4090", False, {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    (r"\brtx 3090\b(?! ti)", "GeForce RTX 3090", False, {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    (r"\bv100s\b", "V100S PCIe", False, {"fp32": 16.4, "fp16": 130.0}),
    (r"\bv100\b.*\bpcie\b", "V100 PCIe", False, {"fp32": 14.0, "fp16": 112.0}),
    (r"\bv100\b.*\bsxm", "V100 SXM2", False, {"fp32": 15.7, "fp16": 125.0}),
    (r"\bv100\b", "V100 (form factor not in the name: SXM2 assumed)", True, {"fp32": 15.7, "fp16": 125.0}),
    (r"\bt4\b", "T4", False, {"fp32": 8.1, "fp16": 65.0}),
)
_COMPILED = tuple((re.compile(pattern), model, family, figures) for pattern, model, family, figures in _ROWS)


@dataclass(frozen=True)
class DensePeak:
    """One GPU model's dense peak in one dtype.

    Attributes:
        tflops: dense TFLOP/s (10^12 floating-point operations per second) from the data sheet.
        dtype: ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.
        model: the table's model the device name matched (``"H100 SXM"``).
        estimated: the name matched only a family row (the form factor was assumed).
    """

    tflops: float
    dtype: str
    model: str
    estimated: bool

    @property
    def source(self) -> str:
        """Where the figure comes from, for a report: ``"data sheet, H100 SXM"`` or ``"estimated, ..."``."""
        return f"{'estimated' if self.estimated else 'data sheet'}: {self.model} {self.dtype} dense"


def dense_peak(gpu_name: str | None, dtype: str) -> DensePeak | None:
    """The dense data-sheet peak of the GPU called ``gpu_name`` in ``dtype``.

    Args:
        gpu_name: the device name as NVML or CUDA reports it (``"NVIDIA H100 80GB HBM3"``).
        dtype: one of :data:`PEAK_DTYPES`.

    Returns:
        The peak, or ``None`` when the name is not in the table or the GPU has no figure for
        ``dtype`` (a V100 in bf16).

    Raises:
        ValueError: ``dtype`` is not one of :data:`PEAK_DTYPES` (a programming error, not user input).
    """
    if dtype not in PEAK_DTYPES:
        raise ValueError(f"dense_peak: dtype {dtype!r} is not one of {PEAK_DTYPES}")
    if not gpu_name:
        return None
    lowered = " ".join(gpu_name.lower().split())
    for pattern, model, family, figures in _COMPILED:
        if pattern.search(lowered):
            tflops = figures.get(dtype)
            return None if tflops is None else DensePeak(tflops, dtype, model, family)
    return None


def peak_table() -> list[tuple[str, bool, dict[str, float]]]:
    """Every row of the table: ``(model, family fallback?, {dtype: dense TFLOP/s})`` (for docs and tests)."""
    return [(model, family, dict(figures)) for _, model, family, figures in _ROWS]


# data-sheet memory bandwidth, GB/s (10^9 bytes/s), most specific name first
_MEMORY_GBPS: tuple[tuple[str, float], ...] = (
    (r"\bb200\b", 8000.0), (r"\bh200\b", 4800.0), (r"\bh100 nvl\b", 3900.0), (r"\bh100 pcie\b", 2000.0),
    (r"\bh100\b", 3350.0), (r"\bh800\b", 3350.0), (r"\ba100\b.*80gb.*pcie|\ba100\b.*pcie.*80gb", 1935.0),
    (r"\ba100\b.*80gb", 2039.0), (r"\ba100\b", 1555.0), (r"\ba30\b", 933.0), (r"\ba40\b", 696.0),
    (r"\ba10\b", 600.0), (r"\bl40s?\b", 864.0), (r"\bl4\b", 300.0), (r"\brtx 4090\b", 1008.0),
    (r"\brtx 3090\b(?! ti)", 936.0), (r"\brtx a6000\b", 768.0), (r"\bv100s\b", 1134.0), (r"\bv100\b", 900.0),
    (r"\bt4\b", 320.0),
)


def memory_bandwidth_gbps(gpu_name: str | None) -> float | None:
    """The data sheet's memory bandwidth of the GPU called ``gpu_name`` in GB/s (10^9 bytes/s);
    ``None`` when the name is not in the table."""
    lowered = " ".join((gpu_name or "").lower().split())
    for pattern, gbps in _MEMORY_GBPS:
        if re.search(pattern, lowered):
            return gbps
    return None
