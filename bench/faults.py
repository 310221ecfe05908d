"""Reliability battery, faults (issue 9, items 1-6): each scenario runs as real processes,
several times, through ``gpukit run --cpu --nproc 2`` (or torchrun, or plain python), and must
end as the README promises.

    PYTHONPATH=src python bench/faults.py [--trials N] [--only SUBSTRING]

Prints one Markdown row per scenario: scenario | trials | failures | result. ``--trials``
scales every scenario (the clean-exit scenarios run 10x as many: they are what fails rarely).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "launch" / "scripts"
MARKER = "GPUKIT_TEST_MARKER"
RUN = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0"]


def _wait_for(paths: list[Path], proc: subprocess.Popen[bytes], timeout_s: float = 120) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _survivors(marker: str, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            for proc in alive:
                proc.kill()
            return len(alive)
        time.sleep(0.1)


def _start(command: list[str], out: Path, extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, **(extra_env or {})}
    log = open(out / "log.txt", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True), marker


def _log(out: Path) -> str:
    return (out / "log.txt").read_text(errors="replace")


def clean_exit(env: dict[str, str] | None = None, torchrun: bool = False) -> Callable[[Path], str | None]:
    def trial(out: Path) -> str | None:
        command = [*(TORCHRUN if torchrun else RUN), str(SCRIPTS / "tiny_exit.py")]
        proc, _ = _start(command, out, env)
        code = proc.wait(timeout=300)
        return None if code == 0 else f"exit {code}: {_log(out).strip().splitlines()[-1][:120]}"
    return trial


def sigkill_worker(out: Path) -> str | None:
    proc, marker = _start([*RUN, "--grace", "5", str(SCRIPTS / "session_stop.py"), str(out)], out)
    if not _wait_for([out / "pid-0", out / "pid-1"], proc):
        return f"did not start: {_log(out)[-200:]}"
    os.kill(int((out / "pid-1").read_text()), signal.SIGKILL)
    code = proc.wait(timeout=120)
    root = next((line for line in _log(out).splitlines() if "failed:" in line), "")
    if code != 137 or not root.startswith("gpukit: rank 1 ") or "out-of-memory" not in root:
        return f"exit {code}, summary {root[:100]!r}"
    return f"{_survivors(marker)} processes left" if _survivors(marker) else None


def stall(out: Path) -> str | None:
    proc, marker = _start([*RUN, "--grace", "2", "--timeout", "6", str(SCRIPTS / "stall.py"), str(out)], out)
    code = proc.wait(timeout=180)
    log = _log(out)
    root = next((line for line in log.splitlines() if "failed:" in line), "")
    if code != 124 or "rank 1 stalled at" not in log or not root.startswith("gpukit: rank 1 "):
        return f"exit {code}, summary {root[:100]!r}"
    return None


def save_on_rank_zero(out: Path) -> str | None:
    proc, _ = _start([*RUN, "--grace", "2", "--timeout", "4", str(SCRIPTS / "save_rank0.py"), str(out)], out)
    code = proc.wait(timeout=180)
    return None if code == 1 and "Call it on every rank" in _log(out) else f"exit {code}"


def preempt(target: str) -> Callable[[Path], str | None]:
    def trial(out: Path) -> str | None:
        proc, marker = _start([*RUN, "--grace", "30", str(SCRIPTS / "preempt_train.py"), str(out)], out)
        if not _wait_for([out / "pid-0", out / "pid-1"], proc):
            return f"did not start: {_log(out)[-200:]}"
        if target == "launcher":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(int((out / "pid-1").read_text()), signal.SIGTERM)
        code = proc.wait(timeout=180)
        saved = list((out / "ckpt").glob("step_*/rank_00001.pt"))
        if code != 75 or not saved:
            return f"exit {code}, checkpoint {'saved' if saved else 'missing'}"
        return None
    return trial


def launcher_sigkill(out: Path) -> str | None:
    proc, marker = _start([*RUN, str(SCRIPTS / "spawner.py"), str(out)], out)
    if not _wait_for([out / "ready-0", out / "ready-1"], proc):
        return f"did not start: {_log(out)[-200:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = _survivors(marker)
    return f"{left} processes survived" if left else None


def loader_resume(out: Path) -> str | None:
    test = ROOT / "tests" / "data" / "test_loader_resume_workers.py"
    code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                          capture_output=True, cwd=ROOT).returncode
    return None if code == 0 else f"pytest exit {code}"


SCENARIOS: list[tuple[str, int, Callable[[Path], str | None], str]] = [
    ("clean exit: gpukit run, 2 processes", 10, clean_exit(), "exit 0"),
    ("clean exit: same, gpukit's exit hook disabled", 5, clean_exit({"TINY_EXIT_UNFIXED": "1"}),
     "exit 0; failures here are the bug the hook fixes"),
    ("clean exit: torchrun, 2 processes", 2, clean_exit(torchrun=True), "exit 0"),
    ("SIGKILL one worker (OOM killer)", 2, sigkill_worker, "exit 137, rank 1 named, 'out-of-memory', nothing left"),
    ("rank 1 stalls (hang), --timeout 6", 1, stall, "exit 124, rank 1 named with its stack while rank 0 waits"),
    ("`if is_main: gpukit.save`", 1, save_on_rank_zero, "exit 1, 'Call it on every rank' within --timeout"),
    ("SIGTERM to launcher, 2 loader workers/rank", 1, preempt("launcher"), "exit 75, both ranks saved"),
    ("SIGTERM to one worker's process group", 1, preempt("group"), "exit 75, both ranks saved"),
    ("SIGKILL the launcher", 1, launcher_sigkill, "no worker, subprocess or loader worker left"),
    ("mid-epoch resume after SIGKILL, 0/2 workers, +-augment", 1, loader_resume, "bit-identical (4 cases)"),
]


def _one(trial: Callable[[Path], str | None]) -> str | None:
    with tempfile.TemporaryDirectory(prefix="gpukit-fault-") as tmp:
        try:
            return trial(Path(tmp))
        except Exception as exc:  # noqa: BLE001 - a crashed trial is a failed trial
            return f"{type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    print("| scenario | trials | failures | result |\n|---|---|---|---|", flush=True)
    for name, scale, trial, expected in SCENARIOS:
        if args.only and args.only not in name:
            continue
        trials = scale * args.trials
        # the clean-exit runs are independent: two at a time, as jobs share a machine
        with ThreadPoolExecutor(2 if name.startswith("clean exit") else 1) as pool:
            notes = [n for n in pool.map(lambda _: _one(trial), range(trials)) if n]
        failures = len(notes)
        result = f"ok: {expected}" if not failures else f"FAILED ({expected} expected): {notes[0]}"
        print(f"| {name} | {trials} | {failures} | {result} |", flush=True)


if __name__ == "__main__":
    main()
