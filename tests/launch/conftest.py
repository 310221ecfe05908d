"""Fixtures for launcher tests."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from launch_helpers import MARKER_ENV, Run, gpukit_command, processes_with_marker


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """start_run(*gpukit_run_args, env=None) -> Run; output dir is the last arg of `behave`."""
    runs: list[Run] = []

    def start(*args: str, env: dict[str, str] | None = None, out: Path | None = None,
              prefix: tuple[str, ...] = (), cwd: Path | None = None) -> Run:
        marker = uuid.uuid4().hex
        out = out or tmp_path / f"out-{len(runs)}"
        out.mkdir(exist_ok=True)
        log = tmp_path / f"log-{len(runs)}.txt"
        full_env = {**os.environ, MARKER_ENV: marker, **(env or {})}
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [*prefix, *gpukit_command("run", *[a.replace("{out}", str(out)) for a in args])],
                stdout=sink, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
            )
        run = Run(proc, marker, out, log)
        runs.append(run)
        return run

    yield start
    for run in runs:  # a failed test must not leave a run behind
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        for proc in processes_with_marker(run.marker):
            try:
                proc.kill()
            except psutil.Error:
                pass


@pytest.fixture
def clean_stop_flag() -> Iterator[None]:
    """No stop request and no preemption handler before or after the test."""
    from gpukit.launch import clear_stop_request, uninstall_preemption_handler

    uninstall_preemption_handler()  # a Session made by an earlier test installed it
    clear_stop_request()
    yield
    uninstall_preemption_handler()
    clear_stop_request()
