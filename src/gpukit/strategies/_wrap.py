"""FSDP's wrapping policy: gpukit.memory's (``memory/_blocks.py``), which the planner shares."""

from __future__ import annotations

from gpukit.memory import (
    BLOCK_TYPES,
    DEFAULT_MIN_UNIT_PARAMS,
    AutoWrap,
    find_blocks,
    unit_param_counts,
    units_to_shard,
)

__all__ = ["AutoWrap", "BLOCK_TYPES", "DEFAULT_MIN_UNIT_PARAMS", "find_blocks", "unit_param_counts", "units_to_shard"]
