"""FSDP's wrapping policy: see :mod:`gpukit.memory._blocks` (the planner shares it)."""

from __future__ import annotations

from gpukit.memory._blocks import (
    BLOCK_TYPES,
    DEFAULT_MIN_UNIT_PARAMS,
    AutoWrap,
    find_blocks,
    unit_param_counts,
    units_to_shard,
)

__all__ = ["AutoWrap", "BLOCK_TYPES", "DEFAULT_MIN_UNIT_PARAMS", "find_blocks", "unit_param_counts", "units_to_shard"]
