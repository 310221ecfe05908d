"""GPUs held by processes left over from earlier runs (gpukit claims: :mod:`gpukit.doctor._claims`).

A process on a GPU (as NVML lists it) is suspect when:

* no such pid exists in this pid namespace: it died while the driver still holds its memory
  (in a container NVML shows host pids, so there it may also be another container's job:
  reported as ``info``);
* it is defunct (a zombie): it exited but its parent has not reaped it;
* it is orphaned: ``gpukit run`` started it and that launcher is gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from gpukit._util.units import format_bytes
from gpukit.devices import GpuProcess, GpuSnapshot, is_fake_backend
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding
from gpukit.errors import GpukitError
from gpukit.worker import WorkerEnv

__all__ = ["ProcessState", "inspect_pid", "check_gpu_processes"]

Kind = Literal["running", "missing", "zombie", "orphaned"]


@dataclass(frozen=True)
class ProcessState:
    """What this machine knows about a pid: ``kind``, its parent, and the launcher it came from."""

    kind: Kind
    ppid: int | None = None
    parent_command: str | None = None
    launcher_pid: int | None = None


def _command(proc: object) -> str | None:
    import psutil

    try:
        return " ".join(proc.cmdline()) or proc.name()  # type: ignore[attr-defined]
    except (psutil.Error, OSError):
        return None


def inspect_pid(pid: int) -> ProcessState:
    """Classify ``pid`` with psutil (see the module docstring)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        status = proc.status()
        ppid = proc.ppid()
    except psutil.NoSuchProcess:
        return ProcessState("missing")
    except psutil.AccessDenied:
        return ProcessState("running")
    parent_command = None
    try:
        parent_command = _command(psutil.Process(ppid)) if ppid else None
    except psutil.Error:
        pass
    if status == psutil.STATUS_ZOMBIE:
        return ProcessState("zombie", ppid, parent_command)
    try:
        launcher_pid = WorkerEnv.from_env(proc.environ()).launcher_pid
    except (psutil.Error, OSError, GpukitError):  # another user's process (its environment is private),
        launcher_pid = None  # or variables no gpukit launcher wrote: not one of its workers
    if launcher_pid is not None and not _launcher_alive(launcher_pid, proc):
        return ProcessState("orphaned", ppid, parent_command, launcher_pid)
    return ProcessState("running", ppid, parent_command)


def _launcher_alive(pid: int, worker: object) -> bool:
    """Whether the launcher that started ``worker`` still runs: a process with its pid that
    started after the worker is another one that got the pid after the launcher ended."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= worker.create_time()  # type: ignore[attr-defined]
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True  # cannot tell: not an orphan


def _in_container() -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
    except OSError:
        return False
    return any(word in cgroup for word in ("docker", "kubepods", "containerd", "lxc"))


def _who(proc: GpuProcess) -> str:
    user = proc.user or "user n/a"
    command = proc.command or "command n/a"
    return f"pid {proc.pid} ({user}: {command[:60]})"


def _held(proc: GpuProcess, unit: GpuSnapshot) -> str:
    memory = "" if proc.used_memory_bytes is None else f"{format_bytes(proc.used_memory_bytes)} on "
    return f"{memory}{unit.label}"


def _finding_for(proc: GpuProcess, unit: GpuSnapshot, state: ProcessState) -> Finding:
    details = {"pid": proc.pid, "user": proc.user, "command": proc.command, "gpu_index": unit.index,
               "gpu_uuid": unit.uuid, "used_memory_bytes": proc.used_memory_bytes, "state": state.kind,
               "ppid": state.ppid, "launcher_pid": state.launcher_pid}
    name = "gpu.processes"
    if state.kind == "zombie":
        parent = f"{state.ppid} ({(state.parent_command or 'command n/a')[:60]})"
        return Finding(name, "warn", f"{_who(proc)} holds {_held(proc, unit)} but is defunct: it exited and its "
                       f"parent {parent} has not reaped it",
                       f"end the parent (kill {state.ppid}); the memory is freed once the zombie is reaped", details)
    if state.kind == "orphaned":
        return Finding(name, "warn", f"{_who(proc)} holds {_held(proc, unit)}; it was started by `gpukit run` "
                       f"(launcher pid {state.launcher_pid}), which is gone: a worker left from an earlier run",
                       f"kill {proc.pid}" + (f" (as {proc.user}, or with sudo)" if proc.user else ""), details)
    return Finding(name, "warn", f"{_who(proc)} holds {_held(proc, unit)}, but no such process exists: it died "
                   "while the driver still holds its memory (or its pid namespace hides it)",
                   f"`nvidia-smi --query-compute-apps=pid,used_memory --format=csv` and kill the pid; memory with "
                   f"no process left needs `sudo nvidia-smi --gpu-reset -i {unit.index}`", details)


def _outside_container(procs: list[tuple[GpuProcess, GpuSnapshot]]) -> Finding:
    # Inside a container NVML reports host pids: other containers' processes and dead ones look alike.
    listed = "; ".join(f"pid {p.pid} {_held(p, u)}" for p, u in procs)
    return Finding("gpu.processes", "info",
                   f"{len(procs)} GPU process(es) are outside this container's pid namespace ({listed}): other "
                   "containers' jobs, or dead processes whose memory the driver still holds",
                   "on the host: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`, then kill "
                   "leftover pids", {"pids": [p.pid for p, _ in procs]})


def check_gpu_processes(ctx: DoctorContext, inspect: Callable[[int], ProcessState] | None = None,
                        in_container: bool | None = None) -> list[Finding]:
    """Processes on the GPUs that are dead, defunct or orphaned (pids, users, commands, how to free them).

    Args:
        ctx: the gathered facts.
        inspect: classifies a pid (default :func:`inspect_pid`, with psutil; with a fake NVML a
            pid missing here counts as alive, since the fake's processes live in its spec only).
        in_container: whether this runs in a container (default: detected).
    """
    units = [(p, u) for g in ctx.gpus for u in ((g,) if not g.mig_devices else g.mig_devices) for p in u.processes]
    if not ctx.gpus:
        return [Finding("gpu.processes", "info", "no NVIDIA GPU, so no GPU processes to check")]
    container = _in_container() if in_container is None else in_container
    fake = inspect is None and is_fake_backend()
    inspect = inspect or inspect_pid
    findings: list[Finding] = []
    elsewhere: list[tuple[GpuProcess, GpuSnapshot]] = []
    for proc, unit in units:
        state = inspect(proc.pid)
        if state.kind == "missing" and (fake or container):
            if container and not fake:
                elsewhere.append((proc, unit))
        elif state.kind != "running":
            findings.append(_finding_for(proc, unit, state))
    if elsewhere:
        findings.append(_outside_container(elsewhere))
    if findings:
        return findings
    users = sorted({p.user for p, _ in units if p.user})
    message = (f"{len(units)} process(es) on the GPUs, all alive ({', '.join(users) or 'users n/a'})"
               if units else "no process on any GPU")
    return [Finding("gpu.processes", "ok", message, None, {"count": len(units)})]
