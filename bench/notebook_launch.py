"""Launching 2 CPU workers from a notebook-like process: gpukit (fork) vs accelerate.notebook_launcher.

    python bench/notebook_launch.py [--rounds 5]

The timed code runs in a child ``python -c`` process, whose ``__main__`` has no file -- what a
notebook kernel looks like to a launcher -- so the worker function is defined "in a cell" and
only a forked worker can run it. Per round, interleaved: ``accelerate.notebook_launcher(work,
num_processes=2)``, ``gpukit.launch.launch_function(work, nproc=2, cpu=True)`` and
``Session(accelerator="cpu", devices=2).launch(step)`` (a Session per worker + one DDP step).
``work`` joins a gloo group and all-reduces one tensor. Prints each launch's wall time, the
medians and gpukit's ratio to accelerate. accelerate returns no per-rank results; gpukit does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn

def work(x):
    import os
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    t = torch.tensor(float(os.environ["RANK"]))
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item() * x

def step(session):
    model = nn.Linear(4, 1)
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    return session.rank

from accelerate import notebook_launcher
import gpukit
from gpukit.launch import launch_function

times = {"accelerate notebook_launcher": [], "gpukit launch_function": [], "gpukit Session.launch": []}
for _ in range(ROUNDS):
    t0 = time.perf_counter(); notebook_launcher(work, (2,), num_processes=2)
    times["accelerate notebook_launcher"].append(time.perf_counter() - t0)
    t0 = time.perf_counter(); assert launch_function(work, (2,), nproc=2, cpu=True, echo=None) == [2.0, 2.0]
    times["gpukit launch_function"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    assert gpukit.Session(accelerator="cpu", devices=2, verbose=False).launch(step) == [0, 1]
    times["gpukit Session.launch"].append(time.perf_counter() - t0)
print("RESULT " + json.dumps(times))
'''


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("ROUNDS", str(rounds))], env=env,
                          capture_output=True, text=True, timeout=60 * rounds + 120)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-3000:])
    import json
    import statistics

    times = json.loads(proc.stdout.split("RESULT ", 1)[1])
    base = statistics.median(times["accelerate notebook_launcher"])
    load = os.getloadavg()
    print(f"{rounds} interleaved rounds; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print("| launcher (2 CPU workers, forked) | median s | each (s) | ratio to accelerate |")
    print("|---|---:|---|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {', '.join(f'{v:.2f}' for v in values)} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
