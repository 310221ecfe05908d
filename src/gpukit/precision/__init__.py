"""Numeric precision: how the model's weights are stored and how its maths runs.

=============  ===========================  =========================================
name           weights / maths              notes
=============  ===========================  =========================================
"32-true"      fp32 / fp32                  the plain PyTorch default
"bf16-mixed"   fp32 / bf16 under autocast   no loss scaling needed (bf16 has fp32 range)
"16-mixed"     fp32 / fp16 under autocast   GradScaler scales the loss, skips inf steps
"bf16-true"    bf16 / bf16                  normalisation layers kept in fp32
"16-true"      fp16 / fp16                  normalisation layers kept in fp32
"auto"         bf16-mixed on GPUs with native bf16, 16-mixed on older GPUs,
               32-true on the CPU and other devices
=============  ===========================  =========================================

An unsupported combination (bf16 on a GPU without native bf16, fp16 autocast on a device
without it) raises :class:`~gpukit.errors.ConfigurationError`; nothing falls back silently.
"""

from __future__ import annotations

from gpukit._util.precision_names import PRECISIONS
from gpukit.precision._autocast import AutocastForward
from gpukit.precision._casting import _cast, cast_inputs_hook, cast_outputs_hook  # noqa: F401 - _cast: tests read it
from gpukit.precision._precisions import (
    NORM_LAYERS, STATS_NORM_LAYERS, MixedPrecision, Precision, TruePrecision, add_true_precision_casts,
    fsdp_own_unit_layers, get_precision,
)

__all__ = [
    "PRECISIONS",
    "cast_inputs_hook",
    "cast_outputs_hook",
    "AutocastForward",
    "Precision",
    "MixedPrecision",
    "TruePrecision",
    "get_precision",
    "NORM_LAYERS",
    "STATS_NORM_LAYERS",
    "fsdp_own_unit_layers",
    "add_true_precision_casts",
]
