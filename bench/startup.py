"""Start-up: `gpukit ls` and `gpukit doctor` wall time against bare python, interleaved.

    python bench/startup.py [--reps 15] [--before-src DIR]

Each command runs as a fresh process; the commands take turns (the order rotates every round)
and medians are reported with the load average, since on a machine busy with other work the
wall time is mostly the wait for a core (the CPU time column shows the work itself). `gpukit ls`
reads the fake 4-GPU spec in examples/ (no NVIDIA driver needed). Also the first
`CheckpointManager.resume` of an unsharded checkpoint in a fresh process (imports included),
`gpukit --version`, and a first GPU claim in a fresh process (on the fake spec). With
``--before-src DIR`` (an older ``src/``, e.g. ``git archive <commit> src``) every gpukit case
also runs on that code, interleaved with the others, so before and after are measured alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_RESUME = """
import sys, time
t = time.perf_counter()
from torch import nn
from gpukit import CheckpointManager
model = nn.Linear(8, 8)
CheckpointManager(sys.argv[1]).resume(model=model)
print(time.perf_counter() - t)
"""


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the child) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


_CLAIM = "import sys, gpukit; gpukit.claim_gpus(1, claim_dir=sys.argv[1]).release()"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--before-src", help="an older src/ directory: its gpukit cases run too, interleaved")
    args = parser.parse_args()
    env = {**os.environ, "GPUKIT_FAKE_GPUS": str(ROOT / "examples" / "fake-gpus" / "shared-4gpu.json"),
           "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", "import sys; from torch import nn; from gpukit import "
                        "CheckpointManager; CheckpointManager(sys.argv[1]).save(1, model=nn.Linear(8, 8))", tmp],
                       env=env, check=True)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "gpukit ls": [sys.executable, "-m", "gpukit", "ls"],
            "gpukit doctor": [sys.executable, "-m", "gpukit", "doctor"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "first resume (fresh process)": [sys.executable, "-c", _RESUME, tmp],
            "gpukit --version": [sys.executable, "-m", "gpukit", "--version"],
            "first claim (fresh process)": [sys.executable, "-c", _CLAIM, tmp + "/claims"],
        }
        envs = {name: env for name in cases}
        if args.before_src:
            for name in [n for n in cases if "gpukit" in n or "first" in n]:
                cases[f"before: {name}"] = cases[name]
                envs[f"before: {name}"] = {**env, "PYTHONPATH": args.before_src}
        load_before = os.getloadavg()
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        names = list(cases)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                times[name].append(_run(cases[name], envs[name]))
    load_after = os.getloadavg()
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(f"{args.reps} interleaved runs each, medians; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    for name in names:
        base = "python -c 'import torch'" if "first resume" in name else "python -c pass"
        over = "" if name == base or name == "python -c pass" else (
            f"  over {base}: {1e3 * (wall[name] - wall[base]):+6.0f} ms wall, {1e3 * (cpu[name] - cpu[base]):+6.0f} ms CPU")
        print(f"  {name:<30} {1e3 * wall[name]:7.0f} ms wall {1e3 * cpu[name]:6.0f} ms CPU{over}")


if __name__ == "__main__":
    main()
