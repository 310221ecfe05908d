"""Byte sizes: parsing what users type and formatting what gpukit prints."""

from __future__ import annotations

import math
import re

from gpukit.errors import ConfigurationError

__all__ = ["parse_size", "format_bytes", "whole_number", "MIB", "GIB"]

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

# Binary units throughout: "8G" means 8 GiB, as nvidia-smi and the CUDA docs mean it.
_UNITS = {
    "": 1,
    "b": 1,
    "k": KIB, "kb": KIB, "kib": KIB,
    "m": MIB, "mb": MIB, "mib": MIB,
    "g": GIB, "gb": GIB, "gib": GIB,
    "t": TIB, "tb": TIB, "tib": TIB,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
ACCEPTED_FORMS = "a byte count (e.g. 8589934592) or a number with a unit: 8GiB, 8000MiB, 8G, 512M, 1.5GiB"


_WHOLE_RE = re.compile(r"[0-9]{1,18}")


def whole_number(text: str) -> int | None:
    """``text`` (stripped) as an int when it is 1-18 ASCII digits, else ``None``.

    Not ``str.isdigit()``: that is true for '²' and other digits ``int()`` refuses, and ``int()``
    of thousands of digits raises -- text from files and environments may hold either.
    """
    stripped = text.strip()
    return int(stripped) if _WHOLE_RE.fullmatch(stripped) else None


def parse_size(value: str | int | float) -> int:
    """Parse a memory size into bytes.

    Args:
        value: ``"8GiB"``, ``"8000MiB"``, ``"8G"``, ``"8gb"``, a byte count as ``int`` or digits.
            Units are binary (``G`` == ``GiB``).

    Returns:
        The size in bytes.

    Raises:
        ConfigurationError: for anything else, naming the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"Invalid size {value!r}: expected {ACCEPTED_FORMS}.")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigurationError(f"Invalid size {value!r}: a size cannot be negative.")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigurationError(f"Invalid size {value!r}: expected {ACCEPTED_FORMS}.")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):  # "9" * 400 parses as inf, which int() cannot hold
        raise ConfigurationError(f"Invalid size {str(value)[:40]!r}...: too large to be a size; expected {ACCEPTED_FORMS}.")
    return int(size)


def format_bytes(num_bytes: int | float | None) -> str:
    """``1536 * MIB`` -> ``"1.50 GiB"``; ``None`` -> ``"n/a"``."""
    if num_bytes is None:
        return "n/a"
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"
