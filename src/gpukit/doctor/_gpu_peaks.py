"""Spec-sheet peaks the active check compares its measurements with.

Dense (no 2:4 sparsity) tensor-core TFLOP/s with fp32 accumulation, as the vendor's data sheet
states them: what a large ``torch.matmul`` in bf16 (or fp16 where the GPU has no bf16) can reach.
Measured products reach 70-85% of these on a healthy GPU (an H100 SXM: 798 of 989, 81%).
"""

from __future__ import annotations

__all__ = ["spec_peak_tflops"]

# (substring of the NVML name, lower case; bf16 TFLOP/s or None where the GPU has no bf16; fp16 TFLOP/s)
# Most specific first: "h100 pcie" before "h100".
_PEAKS: tuple[tuple[str, float | None, float], ...] = (
    ("b200", 2250.0, 2250.0),
    ("gh200", 989.4, 989.4),
    ("h200 nvl", 835.5, 835.5),
    ("h200", 989.4, 989.4),
    ("h100 pcie", 756.5, 756.5),
    ("h100 nvl", 835.5, 835.5),
    ("h100", 989.4, 989.4),
    ("h800", 989.4, 989.4),
    ("a100", 312.0, 312.0),
    ("a800", 312.0, 312.0),
    ("a30", 165.0, 165.0),
    ("a40", 149.7, 149.7),
    ("rtx a6000", 154.8, 154.8),
    ("l40s", 362.1, 362.1),
    ("l40", 181.0, 181.0),
    ("l4", 121.0, 121.0),
    ("a10", 125.0, 125.0),
    ("rtx 4090", 165.2, 165.2),
    ("rtx 3090", 71.0, 71.0),
    ("v100", None, 125.0),
    ("t4", None, 65.0),
)


def spec_peak_tflops(name: str | None, dtype: str) -> float | None:
    """The data sheet's dense peak for GPU ``name`` in ``dtype`` (``"bf16"`` or ``"fp16"``); ``None`` if unknown."""
    if not name or dtype not in ("bf16", "fp16"):
        return None
    lowered = name.lower()
    for pattern, bf16, fp16 in _PEAKS:
        if pattern in lowered:
            return bf16 if dtype == "bf16" else fp16
    return None
