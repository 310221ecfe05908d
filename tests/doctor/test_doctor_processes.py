"""GPUs held by defunct, orphaned or vanished processes (real pids, fake NVML)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterator

import psutil
import pytest

from gpukit.doctor._processes import ProcessState, _launcher_alive, check_gpu_processes, inspect_pid

_GPU = {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaaaaaa-1111-4222-8333-444444444444",
        "memory_total_mib": 40960, "memory_used_mib": 9000}


def _spec(*procs: tuple[int, str]) -> dict:
    return {"driver_version": "550.54.15", "gpus": [dict(_GPU, processes=[
        {"pid": pid, "user": "alice", "command": command, "used_memory_mib": 1000} for pid, command in procs])]}


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


@pytest.fixture
def zombie() -> Iterator[int]:
    """A child that has exited and is not reaped yet: a real defunct process."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    yield proc.pid
    proc.wait()


@pytest.fixture
def orphan() -> Iterator[int]:
    """A process started by a `gpukit run` launcher that no longer exists."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    env = dict(os.environ, GPUKIT_LAUNCHER_PID=str(gone.pid))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    # its first line: the worker runs (Popen already returns after exec, so its environment is
    # readable; the flake this test had was the launcher's pid reused -- see _launcher_alive)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    yield proc.pid
    proc.kill()
    proc.wait()


def test_inspect_pid_classifies_real_processes(zombie, orphan):
    assert inspect_pid(os.getpid()).kind == "running"
    state = inspect_pid(zombie)
    assert state.kind == "zombie" and state.ppid == os.getpid()
    assert inspect_pid(orphan).kind == "orphaned" and inspect_pid(orphan).launcher_pid is not None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert inspect_pid(gone.pid).kind == "missing"


def test_defunct_and_orphaned_gpu_processes_are_named_with_how_to_free_them(use_spec, make_ctx, zombie, orphan):
    use_spec(_spec((os.getpid(), "python train.py"), (zombie, "python old.py"), (orphan, "python worker.py")))
    findings = check_gpu_processes(make_ctx())
    by_pid = {f.details["pid"]: f for f in findings}
    assert set(by_pid) == {zombie, orphan}  # the live process is fine
    assert by_pid[zombie].status == "warn" and "defunct" in by_pid[zombie].message
    assert f"kill {os.getpid()}" in by_pid[zombie].fix  # its parent (this test) must reap it
    assert "alice" in by_pid[orphan].message and "python worker.py" in by_pid[orphan].message
    assert by_pid[orphan].fix.startswith(f"kill {orphan}")


def test_vanished_pid_warns_outside_a_container_and_is_info_inside(use_spec, make_ctx):
    use_spec(_spec((424242, "python train.py")))
    ctx = make_ctx()
    missing = lambda pid: ProcessState("missing")  # noqa: E731
    [finding] = check_gpu_processes(ctx, inspect=missing, in_container=False)
    assert finding.status == "warn" and "no such process" in finding.message and "--gpu-reset -i 0" in finding.fix
    # the fake's processes exist only in its spec: a pid missing here is not a dead run
    [finding] = check_gpu_processes(ctx, in_container=False)
    assert finding.status == "ok"


def test_vanished_pid_in_a_container_is_one_info_finding(use_spec, make_ctx):
    use_spec(_spec((424242, "a"), (424243, "b")))
    missing = lambda pid: ProcessState("missing")  # noqa: E731
    [finding] = check_gpu_processes(make_ctx(), inspect=missing, in_container=True)
    assert finding.status == "info" and finding.details["pids"] == [424242, 424243]


def test_no_processes_is_ok(use_spec, make_ctx):
    use_spec(_spec())
    [finding] = check_gpu_processes(make_ctx())
    assert finding.status == "ok" and "no process" in finding.message


def test_a_launcher_pid_taken_by_a_younger_process_is_an_orphan():
    # the pid was reused: a process with the launcher's pid that started after the worker
    younger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        worker = psutil.Process(os.getpid())  # started before `younger`
        assert not _launcher_alive(younger.pid, worker)
        assert _launcher_alive(os.getppid(), worker)  # our own parent: older, alive
    finally:
        younger.kill()
        younger.wait()
