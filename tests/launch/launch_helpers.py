"""Helpers for launcher tests: start `gpukit run` as a real process, find what survives.

Named launch_helpers (not _helpers) so it cannot clash with another test folder's module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"
BEHAVE = SCRIPTS / "behave.py"
MARKER_ENV = "GPUKIT_TEST_MARKER"


def poll(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    """Return condition()'s first truthy value; fail the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def processes_with_marker(marker: str) -> list[psutil.Process]:
    """Every live process (launcher, workers, their children) that carries the marker."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_ENV) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (SigCgt in /proc/PID/status): the
    moment a signal stops meaning death to it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(mask >> (signum - 1) & 1)


def assert_none_survive(marker: str, timeout_s: float = 15.0) -> None:
    """Zero processes of the run left, polled with a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = processes_with_marker(marker)
        if not alive:
            return
        if time.monotonic() > deadline:
            details = []
            for proc in alive:
                try:
                    details.append(f"{proc.pid} {proc.cmdline()}")
                except psutil.Error:
                    pass
            for proc in alive:  # don't leak them into the rest of the suite
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            pytest.fail(f"processes survived the run: {details}")
        time.sleep(0.05)


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    marker: str
    out: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"gpukit run did not exit within {timeout_s} s; output:\n{self.output()}")

    def files(self, *names: str, timeout_s: float = 60) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"gpukit run exited early ({self.proc.returncode}):\n{self.output()}")
            return all((self.out / name).exists() for name in names)

        poll(ready, timeout_s, f"worker files {names}")


def gpukit_command(*args: str) -> list[str]:
    return [sys.executable, "-c", "from gpukit.cli import main; main()", *args]


# Worker functions for launch_function tests: module level, so spawned workers can import them.
def all_reduce_rank(scale: float) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # everything it needs comes from the launcher's env
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    result = {"rank": float(dist.get_rank()), "world": float(dist.get_world_size()), "sum": value.item() * scale,
              "cpu": float(os.environ.get("GPUKIT_CPU") == "1")}
    dist.barrier()
    dist.destroy_process_group()
    return result


def fail_on_rank_one() -> str:
    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1")
    return "ok"
