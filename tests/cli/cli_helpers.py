"""Run the gpukit CLI in-process and capture what it printed (shared by the CLI tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpukit.cli import main


def importable_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, prefix: str) -> str:
    """Write ``source`` as a uniquely named module in ``tmp_path`` (the working directory, as
    ``gpukit plan`` imports from there) and return its name."""
    name = f"{prefix}_{abs(hash(tmp_path))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return name


def run_gpukit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``gpukit ARGS`` in this process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
