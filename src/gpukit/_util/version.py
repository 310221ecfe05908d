"""gpukit's version, in a module every layer may import (``gpukit.__version__`` re-exports it)."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"  # keep equal to pyproject.toml's version
