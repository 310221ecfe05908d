"""Preemption battery (issue 17): stops at random moments must never lose the run.

    PYTHONPATH=src python bench/preemption.py sigterm [--trials 20] [--modes hooks,python] [--load 2]
    PYTHONPATH=src python bench/preemption.py slurm [--trials 20] [--ways "gpukit run,srun python"]

``sigterm``: SIGTERM to ``gpukit run --cpu --nproc 2`` of a training script with 2 loader
workers per rank, at a random moment up to ``--max-delay`` s after start (``--in-training``:
after both ranks trained a step, the "first steps under load" case), with ``--load`` busy
processes beside it. Every trial must exit 75 (clean stop, whether it had
started training or not). ``--modes`` interleaves how a worker that finished its stop leaves
(``GPUKIT_STOP_EXIT``: ``hooks`` the default, ``python`` the interpreter's own exit, ``now``)
and prints the launcher's exit time for each, side by side.

``slurm``: the real 2-node SLURM cluster (tests/cluster/slurm_cluster.sh): ``--trials`` jobs per
documented way, each warned (``scancel --signal=USR2 --batch``) at a moment drawn from start-up,
worker start, training, save and teardown; a table of requeues, final state, bit-exact weights
and processes left behind (bench/preemption_slurm.py).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))
sys.path.insert(0, str(ROOT / "tests" / "launch"))
TRAIN_LOADERS = ROOT / "tests" / "launch" / "scripts" / "preempt_train.py"
MARKER = "GPUKIT_TEST_MARKER"


def _burners(count: int) -> list[subprocess.Popen[bytes]]:
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def sigterm_trial(mode: str, delay_s: float, after_training_starts: bool = False) -> dict[str, object]:
    """One SIGTERM at ``delay_s`` after start (or after both ranks trained a step); returns exit
    code and seconds to exit."""
    out = Path(tempfile.mkdtemp(prefix="gpukit-preempt-"))
    env = {**os.environ, MARKER: uuid.uuid4().hex, "GPUKIT_STOP_EXIT": mode}
    with (out / "log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", "--grace", "10",
                                 str(TRAIN_LOADERS), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while after_training_starts and time.monotonic() < deadline and proc.poll() is None and not (
            (out / "pid-0").exists() and (out / "pid-1").exists()):
        time.sleep(0.02)
    time.sleep(delay_s)
    training = (out / "pid-0").exists() and (out / "pid-1").exists()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = -9
    took_s = time.monotonic() - sent
    saved = sorted(p.name for p in (out / "ckpt").glob("step_*")) if (out / "ckpt").exists() else []
    return {"mode": mode, "delay_s": delay_s, "training": training, "code": code, "exit_s": took_s,
            "saved": bool(saved), "log": (out / "log").read_text(errors="replace")[-600:]}


def run_sigterm(trials: int, modes: list[str], load: int, max_delay_s: float, training: bool) -> int:
    rng = random.Random(17)
    burners = _burners(load)
    results: list[dict[str, object]] = []
    try:
        for trial in range(trials):
            delay_s = round(rng.uniform(0.0, max_delay_s), 2)
            for mode in modes:  # interleaved: both modes see the same moment and the same load
                result = sigterm_trial(mode, delay_s, training)
                results.append(result)
                print(f"trial {trial:2d} {mode:6s} delay {delay_s:5.2f} s training={result['training']!s:5} "
                      f"exit {result['code']} in {result['exit_s']:.2f} s load {_load()}", flush=True)
                if result["code"] != 75:
                    print(result["log"], flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print("\n| mode | trials | wrong exit codes | trained before the stop | launcher exit after SIGTERM: median / max |")
    print("|---|---|---|---|---|")
    wrong = 0
    for mode in modes:
        mine = [r for r in results if r["mode"] == mode]
        bad = sum(1 for r in mine if r["code"] != 75)
        wrong += bad if mode == modes[0] else 0
        times = [float(r["exit_s"]) for r in mine]
        print(f"| {mode} | {len(mine)} | {bad} | {sum(1 for r in mine if r['training'])} | "
              f"{statistics.median(times):.2f} s / {max(times):.2f} s |")
    return 1 if wrong else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("battery", choices=["sigterm", "slurm"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--modes", default="hooks")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the run (sigterm)")
    parser.add_argument("--max-delay", type=float, default=8.0, help="latest SIGTERM, seconds after start")
    parser.add_argument("--in-training", action="store_true",
                        help="sigterm: measure the delay from the first training step (both ranks trained one)")
    parser.add_argument("--ways", default="gpukit run,srun python", help="slurm: the documented ways to try")
    args = parser.parse_args()
    print(f"# {args.battery}: {os.cpu_count()} CPU(s), load average {_load()} at start", flush=True)
    if args.battery == "sigterm":
        return run_sigterm(args.trials, args.modes.split(","), args.load, args.max_delay, args.in_training)
    from preemption_slurm import run_slurm  # noqa: PLC0415 - the cluster part is apart

    return run_slurm(args.trials, args.ways.split(","))


if __name__ == "__main__":
    sys.exit(main())
