"""The ``gpukit`` command line: thin commands that parse, call the library, and print.

Subcommands are imported only when invoked, so ``gpukit ls`` starts without importing torch.
"""

from __future__ import annotations

from gpukit.cli._main import cli, main

__all__ = ["cli", "main"]
