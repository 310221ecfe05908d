"""Helpers shared by the commands (no torch import: ``ls`` and ``select`` use them)."""

from __future__ import annotations

from gpukit._units import parse_size
from gpukit.errors import ConfigurationError

__all__ = ["parse_size_option"]


def parse_size_option(option: str, value: str | None) -> int | None:
    """``--min-free 8GiB`` -> bytes; a bad value is an error that names the option."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{option}: {exc}") from None
