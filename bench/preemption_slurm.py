"""The SLURM half of bench/preemption.py: random-moment preemptions on the real 2-node cluster.

Each trial submits ``exec srun gpukit run --cpu --nproc 2 train.py OUT --ckpt DIR --step-s 1``
with ``--requeue`` to a cluster started by tests/cluster/slurm_cluster.sh, waits until the job
is RUNNING, waits a random 0..``max_delay_s`` seconds (start-up included: the launchers import
for several seconds), sends ``scancel --signal=USR2 --batch`` (what ``--signal=B:USR2@90``
sends), then follows the job: a requeued job is released at once (``StartTime=now``) and must
finish with the weights of an uninterrupted run. A trial is *lost* when the job leaves the queue
without finishing its training.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slurm_helpers import steps_gone  # tests/cluster, put on sys.path by bench/preemption.py

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "cluster"
TRAIN = CLUSTER / "scripts" / "train.py"
SRC = ROOT / "src"
PYTHON = sys.executable


def _run(env: dict[str, str], *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout_s)


def _state(env: dict[str, str], job: str) -> str:
    result = _run(env, "squeue", "-h", "-j", job, "-o", "%T")
    return result.stdout.strip() if result.returncode == 0 else "UNKNOWN"  # slurmctld too busy to answer


def _restarts(env: dict[str, str], job: str) -> int:
    shown = _run(env, "scontrol", "show", "job", job).stdout
    return int(shown.split("Restarts=")[1].split()[0]) if "Restarts=" in shown else -1


def _moment(output: str) -> str:
    if "stopping at the next step boundary" in output:
        return "training"
    if "Session started: nothing to save" in output:
        return "workers starting"
    if "received while starting" in output or "no worker had started yet" in output:
        return "launcher starting"
    return "after training" if "SIGUSR2" not in output else "other"


def trial(env: dict[str, str], reference: dict, delay_s: float, workdir: Path,
          in_training: bool = False) -> dict[str, object]:
    marker = uuid.uuid4().hex
    job_env = {**env, "PYTHONPATH": str(SRC), "GPUKIT_TEST_MARKER": marker}
    out, ckpt = workdir / "out", workdir / "ckpt"
    out.mkdir(parents=True)
    script = workdir / "job.sbatch"
    script.write_text(f"#!/bin/bash\nexec srun {PYTHON} -m gpukit run --cpu --nproc 2 {TRAIN} {out} "
                      f"--ckpt {ckpt} --step-s 1\n")
    log = workdir / "job.out"
    submitted = _run(job_env, "sbatch", "--parsable", "--export=ALL", "--open-mode=append", "-o", str(log),
                     "-N2", "--requeue", str(script))
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while _state(env, job) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.05)
    while in_training and time.monotonic() < deadline and _state(env, job) in ("RUNNING", "UNKNOWN") and not all(
            (out / f"rank-{r}-attempt-0").exists() for r in range(4)):
        time.sleep(0.05)  # every rank has its Session and starts its first step
    time.sleep(delay_s)  # the random moment (measured from RUNNING, or from the first step)
    _run(env, "scancel", "--signal=USR2", "--batch", job)
    requeued = False
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        state = _state(env, job)
        if state == "":
            break
        if state == "PENDING" and _restarts(env, job) >= 1 and not requeued and steps_gone(job):
            requeued = True  # released once the first run's step daemons are gone (credential race)
            _run(env, "scontrol", "update", f"JobId={job}", "StartTime=now")
        time.sleep(0.2)
    output = log.read_text(errors="replace") if log.exists() else ""
    result_path = out / "result.json"
    same = False
    if result_path.exists():
        got = json.loads(result_path.read_text())
        same = got["steps"] == reference["steps"] and all(
            abs(a - b) <= 1e-5 for mine, theirs in zip(got["params"], reference["params"])
            for a, b in zip(mine, theirs))
    return {"job": job, "delay_s": delay_s, "requeued": requeued, "finished_right": same,
            "moment": _moment(output), "lost": not same, "tail": output[-1500:]}


def run_slurm(trials: int, max_delay_s: float = 20.0, parallel: int = 2, in_training: bool = False) -> int:
    directory = Path(tempfile.mkdtemp(prefix="gpukit-bench-slurm-"))
    started = subprocess.run([str(CLUSTER / "slurm_cluster.sh"), "start", str(directory)], capture_output=True,
                             text=True, timeout=600)
    if started.returncode != 0:
        print(f"no SLURM cluster: {started.stderr.strip()[-300:]}")
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(directory / "slurm.conf")
    try:
        ref_dir = directory / "reference"
        ref_dir.mkdir()
        subprocess.run([PYTHON, str(TRAIN), str(ref_dir)], env={**env, "PYTHONPATH": str(SRC)}, check=True,
                       capture_output=True, timeout=300)
        reference = json.loads((ref_dir / "result.json").read_text())
        rng = random.Random(1717)
        delays = [round(rng.uniform(0.0, max_delay_s), 2) for _ in range(trials)]
        with ThreadPoolExecutor(parallel) as pool:
            futures = [pool.submit(trial, env, reference, delay, directory / f"trial-{i}", in_training)
                       for i, delay in enumerate(delays)]
            results = []
            for i, future in enumerate(futures):
                result = future.result()
                results.append(result)
                print(f"trial {i:2d} delay {result['delay_s']:5.2f} s  moment: {result['moment']:17s} "
                      f"requeued={result['requeued']!s:5} finished with the right weights={result['finished_right']} "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                if result["lost"]:
                    print(result["tail"], flush=True)
    finally:
        subprocess.run([str(CLUSTER / "slurm_cluster.sh"), "stop", str(directory)], capture_output=True, timeout=120)
    lost = sum(1 for r in results if r["lost"])
    moments: dict[str, int] = {}
    for r in results:
        moments[str(r["moment"])] = moments.get(str(r["moment"]), 0) + 1
    print(f"\n| trials | lost | requeued | moments (where the signal landed) |\n|---|---|---|---|\n"
          f"| {len(results)} | {lost} | {sum(1 for r in results if r['requeued'])} | "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(moments.items()))} |")
    return 1 if lost else 0
