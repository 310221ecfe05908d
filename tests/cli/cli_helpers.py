"""Run the gpukit CLI in-process and capture what it printed (shared by the CLI tests)."""

from __future__ import annotations

import pytest

from gpukit.cli import main


def run_gpukit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``gpukit ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
