"""One record line, parsed and checked: known fields with sane types and bounds, or rejected.

Everything downstream (summary, plots, TensorBoard replay) may then trust what it is given:
times are finite, counts are non-negative ints, texts are short strings. A line that cannot be
made sense of is rejected as a whole (``None``) and counted by the reader; a single odd field
in an otherwise good line is left out (``None``: not recorded).
"""

from __future__ import annotations

import json
import math
from typing import Any

from gpukit.errors import ConfigurationError
from gpukit.monitor import RECORD_FORMAT, RECORD_VERSION

__all__ = ["MAX_BRACKETS", "MAX_NAME_CHARS", "MAX_TEXT_CHARS", "parse_line", "short"]

#: Lines with more opening brackets than this are rejected before ``json.loads`` (no recursion).
MAX_BRACKETS = 64
MAX_NAME_CHARS = 80  # scalar names, event kinds, field names
MAX_TEXT_CHARS = 200  # header texts, event details
MAX_SCALARS_PER_LINE = 64
MAX_EVENT_FIELDS = 16
_MAX_T = 1e11  # unix seconds: year 5138
_MAX_COUNT = 2**53
_META_TEXTS = ("host", "device", "strategy", "precision", "gpu_name")
_META_INTS = (("rank", 0), ("world_size", 1), ("local_rank", 0), ("pid", 0), ("restart_count", 0),
              ("gpu_index", 0), ("full_steps", 1))
_STEP_TIMES = ("step_s", "data_s", "h2d_s", "compute_s", "max_step_s")
_SYS_FIELDS = ("gpu_util_pct", "gpu_mem_used_bytes", "gpu_mem_total_bytes", "torch_allocated_bytes",
               "torch_reserved_bytes", "process_rss_bytes", "cpu_pct", "host_mem_used_bytes",
               "host_mem_total_bytes")
_TYPES = ("meta", "step", "sys", "event", "end")


def short(text: str, limit: int = MAX_NAME_CHARS) -> str:
    """``text`` cut to ``limit`` characters, with an ellipsis when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _number(value: Any, low: float = 0.0, high: float = 1e18) -> float | None:
    """A finite number in ``[low, high]``; ints beyond float range and bools are not numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        if not -(2**1000) < value < 2**1000:  # float(value) would overflow
            return None
        value = float(value)
    return value if math.isfinite(value) and low <= value <= high else None


def _count(value: Any, low: int = 0) -> int | None:
    """An int in ``[low, 2**53]`` (a whole float is accepted)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and low <= value <= _MAX_COUNT else None


def _text(value: Any, limit: int = MAX_TEXT_CHARS) -> str | None:
    return short(value, limit) if isinstance(value, str) else None


def _scalar(value: Any) -> float | None:
    """A logged value: NaN and infinities are kept (a diverged loss is worth seeing as a gap)."""
    if isinstance(value, float):
        return value
    return _number(value, -math.inf, math.inf)


def _detail(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return short(value, MAX_TEXT_CHARS) if isinstance(value, str) else value
    number = _number(value, -math.inf, math.inf)
    if number is not None:
        return int(number) if isinstance(value, int) else number
    return short(json.dumps(value, default=str)[: MAX_TEXT_CHARS * 2], MAX_TEXT_CHARS)


def _meta(line: dict[str, Any], source: str) -> dict[str, Any] | None:
    if line.get("format") != RECORD_FORMAT:
        raise ConfigurationError(f"{source} is not a gpukit run record (header format "
                                 f"{short(repr(line.get('format')))}, expected {RECORD_FORMAT!r}).")
    version = _count(line.get("version"), low=1)
    if version is None:
        return None
    if version > RECORD_VERSION:
        raise ConfigurationError(
            f"{source} was written by a newer gpukit (record version {version}; this one reads up to "
            f"{RECORD_VERSION}). Upgrade gpukit to read it.")
    out: dict[str, Any] = {"type": "meta", "version": version}
    for key in _META_TEXTS:
        out[key] = _text(line.get(key))
    for key, low in _META_INTS:
        out[key] = _count(line.get(key), low)
    out["sample_interval_s"] = _number(line.get("sample_interval_s"), 0.0, 1e6)
    return out


def _step(line: dict[str, Any]) -> dict[str, Any] | None:
    step = _count(line.get("step"))
    if step is None:
        return None
    out: dict[str, Any] = {"type": "step", "step": step, "n": _count(line.get("n", 1), low=1) or 1,
                           "epoch": _count(line.get("epoch")), "samples": _count(line.get("samples")),
                           "exact": line.get("exact") is not False}
    for key in _STEP_TIMES:
        out[key] = _number(line.get(key), 0.0, 1e9)
    scalars = line.get("scalars")
    if isinstance(scalars, dict) and scalars:
        kept = {}
        for name, value in list(scalars.items())[:MAX_SCALARS_PER_LINE]:
            number = _scalar(value)
            if number is not None:
                kept[short(name)] = number
        if kept:
            out["scalars"] = kept
    return out


def _sys(line: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "sys"}
    for key in _SYS_FIELDS:
        value = _number(line.get(key), 0.0, 1e20)
        if value is not None:
            out[key] = value
    return out


def _event(line: dict[str, Any]) -> dict[str, Any]:
    kind = line.get("kind")
    out: dict[str, Any] = {"type": "event", "kind": short(kind) if isinstance(kind, str) and kind else "?",
                           "step": _count(line.get("step"))}
    extra = [(k, v) for k, v in line.items() if k not in ("type", "t", "kind", "step")]
    for key, value in extra[:MAX_EVENT_FIELDS]:
        out[short(str(key))] = _detail(value)
    if len(extra) > MAX_EVENT_FIELDS:
        out["…"] = f"{len(extra) - MAX_EVENT_FIELDS} more fields"
    return out


def parse_line(raw: bytes, source: str) -> dict[str, Any] | None:
    """The checked line of ``raw`` (one JSON object), or ``None`` when it is not a usable line.

    Lines of an unknown ``type`` come back as ``{"type": None}`` (a newer writer's: ignored, not
    counted as bad).

    Raises:
        ConfigurationError: a header of another format or of a newer record version.
    """
    if raw.count(b"{") + raw.count(b"[") > MAX_BRACKETS:
        return None
    try:
        line = json.loads(raw)
    except (ValueError, RecursionError):  # torn, not JSON, not UTF-8
        return None
    if not isinstance(line, dict):
        return None
    kind = line.get("type")
    if kind not in _TYPES:
        return {"type": None}
    t = _number(line.get("t"), 0.0, _MAX_T)
    if t is None:
        return None
    if kind == "meta":
        out = _meta(line, source)
    elif kind == "step":
        out = _step(line)
    elif kind == "sys":
        out = _sys(line)
    elif kind == "event":
        out = _event(line)
    else:
        out = {"type": "end", "steps": _count(line.get("steps"))}
    if out is not None:
        out["t"] = t
    return out
