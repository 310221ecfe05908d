"""The warning at random moments on the real 2-node cluster: bench/preemption.py's SLURM battery
(20+ trials per way, a table) and a few trials in test_slurm_trials.py.

Each trial submits the documented job script (examples/slurm/train.sbatch, its srun line running
tests/cluster/scripts/train.py on 2 nodes x 2 processes with a checkpoint every 2 of its 6 steps
of 1 s) in one of the two documented ways -- ``gpukit run`` per node, or ``srun python`` per
process -- with ``--requeue``, to a cluster started by tests/cluster/slurm_cluster.sh. It draws a
moment (start-up, worker start, training, save, teardown), waits for the job to reach it, then a
random time within it, and sends ``scancel --signal=USR2 --batch`` (what ``--signal=B:USR2@90``
sends). It follows the job to its end (a requeued job is released at once, ``StartTime=now``) and
reports: how often it was requeued, its final state, whether the weights are bit-identical to the
same job run without a signal, and how many of its processes outlived it. Expected: one requeue
for a warning before the training ended, none after (a finished run is finished); COMPLETED;
bit-exact; nothing left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from launch_helpers import processes_with_marker
from slurm_helpers import SRC, TRAIN, job_script, steps_gone

PYTHON = sys.executable
MOMENTS = ("start-up", "worker start", "training", "save", "teardown")
WAYS = ("gpukit run", "srun python")
RANKS = 4  # 2 nodes x 2


@dataclass
class Cluster:
    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def state(self, job: str) -> str:
        result = self.run("squeue", "-h", "-j", job, "-o", "%T")
        return result.stdout.strip() if result.returncode == 0 else "UNKNOWN"  # slurmctld too busy

    def show(self, job: str) -> dict[str, str]:
        fields = {}
        for word in self.run("scontrol", "show", "job", job).stdout.split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields


def _submit(cluster: Cluster, way: str, workdir: Path, marker: str) -> tuple[str, Path, Path]:
    out, ckpt = workdir / "out", workdir / "ckpt"
    out.mkdir(parents=True)
    args = f"{TRAIN} {out} --ckpt {ckpt} --step-s 1 --save-every 2"
    step = (f"srun {PYTHON} -m gpukit run --cpu --nproc 2 {args}" if way == "gpukit run"
            else f"srun --kill-on-bad-exit=1 {PYTHON} {args}")
    script = workdir / "job.sbatch"
    script.write_text(job_script(step))
    log = workdir / "job.out"
    env = {**cluster.env, "PYTHONPATH": str(SRC), "GPUKIT_TEST_MARKER": marker}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--export=ALL", "--open-mode=append", "-o", str(log), "-N2",
         f"--ntasks-per-node={1 if way == 'gpukit run' else 2}", "--requeue", str(script)],
        env=env, capture_output=True, text=True, timeout=60)
    if submitted.returncode != 0:
        raise RuntimeError(f"sbatch failed: {submitted.stderr}")
    return submitted.stdout.strip().split(";")[0], out, log


def _reached(moment: str, out: Path) -> bool:
    if moment == "worker start":  # every rank's first line ran (gpukit run: its workers exist)
        return all((out / f"begin-{r}-0").exists() for r in range(RANKS))
    if moment == "training":  # every rank has its Session
        return all((out / f"rank-{r}-attempt-0").exists() for r in range(RANKS))
    if moment == "save":
        return (out / "saving-0-2").exists()
    if moment == "teardown":  # the weights are written: the training is over
        return (out / "result.json").exists()
    return True  # start-up: the job is RUNNING


#: how long after reaching it the signal may land (seconds, drawn uniformly)
_SPREAD_S = {"start-up": 1.0, "worker start": 2.0, "training": 4.0, "save": 0.0, "teardown": 0.5}


def _landed(output: str, after_training: bool) -> str:
    """Where the warning landed, from what the job printed (and whether the weights were written)."""
    if after_training:
        return "after training"
    if "job script: SIGUSR2 came while gpukit could not take it" in output:
        return "nothing could take it"
    if "received while starting" in output:
        return "launcher starting"
    if "Session started: nothing to save" in output or "before its Session" in output:
        return "workers starting"
    if "stopping at the next step boundary" in output:
        return "training"
    return "?"


SPREAD_S = _SPREAD_S


def trial(cluster: Cluster, way: str, moment: str, delay_s: float, reference: dict, workdir: Path) -> dict:
    """One job of ``way`` warned ``delay_s`` after it reached ``moment``; what became of it."""
    marker = uuid.uuid4().hex
    job, out, log = _submit(cluster, way, workdir, marker)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and cluster.state(job) != "RUNNING":
        time.sleep(0.02)
    while time.monotonic() < deadline and cluster.state(job) in ("RUNNING", "UNKNOWN") and not _reached(moment, out):
        time.sleep(0.02)
    reached = _reached(moment, out) and cluster.state(job) in ("RUNNING", "UNKNOWN", "COMPLETING")
    time.sleep(delay_s)
    after_training = (out / "result.json").exists()
    cluster.run("scancel", "--signal=USR2", "--batch", job)
    released = False
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        state = cluster.state(job)
        if state == "":
            break
        if state == "PENDING" and not released and steps_gone(job):
            time.sleep(2)  # a credential second after the revocation (slurmd's whole-second times)
            cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
            released = True
        time.sleep(0.2)
    shown = cluster.show(job)
    left = _processes_left(marker, within_s=10.0)
    result = out / "result.json"
    exact = result.exists() and json.loads(result.read_text())["params"] == reference["params"]
    output = log.read_text(errors="replace") if log.exists() else ""
    return {"way": way, "moment": moment, "reached": reached, "delay_s": delay_s, "job": job,
            "requeues": int(shown.get("Restarts", "-1")), "state": f"{shown.get('JobState', '?')} {shown.get('ExitCode', '?')}",
            "exact": exact, "left": left, "landed": _landed(output, after_training), "tail": output[-2000:]}


def _processes_left(marker: str, within_s: float) -> int:
    """How many of the trial's processes are still alive once the job has left the queue: they get
    ``within_s`` to finish exiting (slurmd reaps a step's tasks after the job's state is gone)."""
    deadline = time.monotonic() + within_s
    while (left := len(processes_with_marker(marker))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def reference(cluster: Cluster, way: str, workdir: Path) -> dict:
    """The same job without a signal: what every trial must end with, bit for bit."""
    job, out, _ = _submit(cluster, way, workdir, uuid.uuid4().hex)
    deadline = time.monotonic() + 600
    while cluster.state(job) != "" and time.monotonic() < deadline:
        time.sleep(0.5)
    return json.loads((out / "result.json").read_text())


def as_expected(r: dict) -> bool:
    """One requeue for a warning before the training ended, none after; COMPLETED, bit-exact, nothing left."""
    want_requeues = 0 if r["landed"] == "after training" else 1
    return r["requeues"] == want_requeues and r["state"] == "COMPLETED 0:0" and r["exact"] and r["left"] == 0


def table(results: list[dict]) -> None:
    """Print the trials as a markdown table, one row per way and moment."""
    print("\n| way | moment | trials | landed | requeues | final state | bit-exact | left behind |")
    print("|---|---|---|---|---|---|---|---|")
    for way in WAYS:
        for moment in MOMENTS:
            mine = [r for r in results if r["way"] == way and r["moment"] == moment]
            if not mine:
                continue

            def counts(key: str, rows: list[dict] = mine) -> str:
                seen: dict[str, int] = {}
                for row in rows:
                    seen[str(row[key])] = seen.get(str(row[key]), 0) + 1
                return ", ".join(f"{k}: {v}" for k, v in sorted(seen.items()))

            print(f"| {way} | {moment} | {len(mine)} | {counts('landed')} | {counts('requeues')} | {counts('state')} | "
                  f"{sum(1 for r in mine if r['exact'])}/{len(mine)} | {sum(r['left'] for r in mine)} |")
