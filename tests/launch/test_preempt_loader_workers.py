"""Preemption of a run whose training processes have DataLoader worker processes.

The stop reaches whole process groups (the launcher's own SIGTERM, a scheduler, a terminal),
loader workers included: they must ignore it so the training process can save a checkpoint.
Under ``gpukit run`` the result is exit 75, whether the launcher or only one worker's process
group was signalled; under plain ``python`` and torchrun the Session honours SIGTERM the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import MARKER_ENV, assert_none_survive, poll

from gpukit.launch import PREEMPTED_EXIT_CODE

SCRIPT = str(Path(__file__).parent / "scripts" / "preempt_train.py")


def _assert_saved(out: Path, ranks: int) -> None:
    steps = {int((out / f"stopped-{rank}").read_text()) for rank in range(ranks)}
    assert len(steps) == 1  # every rank stopped at the same step
    [step_dir] = list((out / "ckpt").glob("step_*"))
    assert sorted(p.name for p in step_dir.glob("rank_*.pt")) == [f"rank_{r:05d}.pt" for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher"])  # "one-worker-group": bench/faults.py runs it
def test_gpukit_run_saves_and_exits_75(start_run, target: str) -> None:
    run = start_run("--cpu", "--nproc", "2", "--grace", "30", SCRIPT, "{out}")
    run.files("pid-0", "pid-1")
    if target == "launcher":
        run.proc.send_signal(signal.SIGTERM)
    else:  # rank 1 and its loader workers, as `kill -TERM -PGID` or a node-local agent would
        os.killpg(int((run.out / "pid-1").read_text()), signal.SIGTERM)
    assert run.wait(90) == PREEMPTED_EXIT_CODE, run.output()
    assert "killed by signal" not in run.output()
    _assert_saved(run.out, 2)
    assert_none_survive(run.marker)


def _start_plain(args: list[str], out: Path, marker: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, MARKER_ENV: marker}
    env.pop("GPUKIT_LAUNCHER_PID", None)
    return subprocess.Popen([*args, SCRIPT, str(out)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_session_honours_sigterm_without_gpukit_run(tmp_path: Path, launcher: str) -> None:
    ranks = 1 if launcher == "python" else 2
    prefix = [sys.executable] if launcher == "python" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:0",
        "--rdzv-backend", "c10d"]
    marker = f"plain-{launcher}-{os.getpid()}"
    proc = _start_plain(prefix, tmp_path, marker)
    try:
        poll(lambda: all((tmp_path / f"pid-{r}").exists() for r in range(ranks)) or proc.poll() is not None,
             90, "the training processes")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        # SIGTERM to the last rank's whole process group: the process and its loader workers
        os.killpg(int((tmp_path / f"pid-{ranks - 1}").read_text()), signal.SIGTERM)
        output = proc.communicate(timeout=90)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "killed by signal" not in output
    _assert_saved(tmp_path, ranks)
    assert_none_survive(marker)
