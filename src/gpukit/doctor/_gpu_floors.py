"""The floors `gpukit doctor --gpu` judges a GPU's SUSTAINED minimum against, per GPU model.

Like DCGM's diagnostics (``dcgmi diag``: per-SKU PCIe and memory-bandwidth thresholds) and the
cloud health checks that gate a node (Azure's HPC node-health checks: host<->device bandwidth
per SKU, GEMM throughput, memory bandwidth), each measurement has a floor, and a finding that
falls short names the floor it missed. What is judged is the slowest of the repeated
measurements, not the best: a link or a GPU that dips now and then slows training all the same.

* host <-> device, pinned: 48 GB/s on PCIe gen5 x16 (76% of its 63 GB/s; healthy H100s measure
  54-56), the same share of any other link (24 GB/s on gen4 x16, 12 on gen3 x16);
* a large bf16 matrix product: 85% of a measured reference for the model (what a healthy one of
  that model does at 8192^3), or -- for a model without one -- 85% of 75% of the data sheet's
  dense peak (a healthy GPU reaches 70-85% of its data-sheet peak);
* device memory (a large device-to-device copy): 75% of the data sheet's memory bandwidth (a
  healthy HBM GPU copies at 80-92% of it).
No torch here: the verdicts are pure functions.
"""

from __future__ import annotations

import re

from gpukit.devices import dense_peak, memory_bandwidth_gbps

__all__ = ["COPY_FLOOR_SHARE", "MATMUL_FLOOR_SHARE", "MEMORY_FLOOR_SHARE", "copy_floor_gbps", "matmul_reference",
           "memory_reference_gbps"]

#: pinned copies each way must sustain this share of the link's peak: 48 GB/s of PCIe gen5 x16's 63
COPY_FLOOR_SHARE = 48.0 / 63.0
#: a matrix product must sustain this share of the model's reference
MATMUL_FLOOR_SHARE = 0.85
#: the reference assumed for a model without a measured one: this share of the data-sheet peak
_ASSUMED_SHARE_OF_PEAK = 0.75
#: device memory must sustain this share of the data sheet's memory bandwidth
MEMORY_FLOOR_SHARE = 0.75

# bf16 8192^3 products measured on healthy GPUs of the model (TFLOP/s): an H100 SXM measured 698 in
# this project's first lent run (clocks not pinned) and 798 in NVIDIA's device notes; H200 is the
# same chip with faster memory, which a compute-bound product does not use
_MEASURED_BF16: tuple[tuple[str, float, str], ...] = (
    (r"\bh200\b(?! nvl)", 750.0, "H200 SXM, 698-798 TFLOP/s measured on the same chip (H100 SXM)"),
    (r"\bh100\b.*\b(sxm|hbm3)", 750.0, "H100 SXM, 698-798 TFLOP/s measured"),
)

def _lower(name: str | None) -> str:
    return " ".join((name or "").lower().split())


def copy_floor_gbps(link_peak_gbps: float | None) -> float | None:
    """The pinned-copy floor for a link of this peak (48 GB/s on gen5 x16); ``None`` when the peak is not known."""
    return None if link_peak_gbps is None else COPY_FLOOR_SHARE * link_peak_gbps


def matmul_reference(gpu_name: str | None, dtype: str) -> tuple[float, str] | None:
    """The TFLOP/s a healthy GPU of this model sustains in a large ``dtype`` product, and where it comes from."""
    if dtype == "bf16":
        for pattern, tflops, said in _MEASURED_BF16:
            if re.search(pattern, _lower(gpu_name)):
                return tflops, f"measured reference: {said}"
    peak = dense_peak(gpu_name, dtype)
    if peak is None:
        return None
    return (_ASSUMED_SHARE_OF_PEAK * peak.tflops,
            f"reference assumed: {_ASSUMED_SHARE_OF_PEAK:.0%} of the {peak.tflops:g} TFLOP/s {peak.source}")


def memory_reference_gbps(gpu_name: str | None) -> float | None:
    """The data sheet's memory bandwidth of this model in GB/s; ``None`` when not in the table."""
    return memory_bandwidth_gbps(gpu_name)
