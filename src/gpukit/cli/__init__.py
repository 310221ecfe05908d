"""The ``gpukit`` command line: thin commands that parse, call the library, and print.

Subcommands are imported only when invoked, so ``gpukit ls`` starts without importing torch.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["cli", "main"]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: gpukit errors become one clear line and exit code 2.

    ``gpukit --version`` is answered without importing click. ``gpukit run`` first (before click, torch, anything heavy) holds on to a scheduler's
    warning signal (SIGUSR1/SIGUSR2), whose default action would kill it while it starts:
    the launcher then stops before starting workers and requeues the job.
    """
    words = sys.argv[1:] if argv is None else argv
    if words == ["--version"]:  # answered before click and importlib.metadata are imported (~20 ms less)
        from gpukit._util.version import __version__

        print(f"gpukit, version {__version__}")
        return
    if words[:1] == ["run"]:
        from gpukit._util.startup_signals import hold_warning_signals

        hold_warning_signals()
    from gpukit.cli._main import main as run_main

    run_main(argv)


def __getattr__(name: str) -> Any:
    if name == "cli":  # the click group, imported only when asked for
        from gpukit.cli._main import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
