"""Launch, start to exit: `gpukit run` against torchrun, `accelerate launch` and bare python.

    python bench/launch.py [--reps 9] [--nproc 1 2] [--before-src DIR]

Every launcher starts the same plain-PyTorch script (no gpukit in it): join a gloo process
group from the environment the launcher set, one all-reduce, leave. What is timed is a whole
launch as a user types it, from the command to the exit of the last process, so the figure is
the launcher's own cost plus the script's. Rounds are interleaved (the order rotates every
round) and medians reported with the load average, wall time and the CPU time of the whole
process tree (RUSAGE_CHILDREN: the launcher and its workers). `accelerate launch --cpu` runs where
accelerate is installed (the `bench` extra), at one process only: on CPU it starts several
processes only through mpirun. With ``--before-src DIR`` (an older ``src/``) gpukit
also runs from that code, interleaved, so before and after are measured alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist

world = int(os.environ.get("WORLD_SIZE", "1"))
assert world == int(sys.argv[1]), f"the launcher started {world} processes, not {sys.argv[1]}"
if world > 1:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size(), t
    dist.destroy_process_group()
"""


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the whole process tree) of one launch; a failed launch stops the bench."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"launch failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _cases(script: str, nproc: int) -> dict[str, list[str]]:
    py = sys.executable
    cases: dict[str, list[str]] = {}
    if nproc == 1:
        cases["python script.py"] = [py, script, "1"]
    cases["torchrun"] = [py, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend",
                         "c10d", "--rdzv-endpoint", "127.0.0.1:0", script, str(nproc)]
    cases["gpukit run"] = [py, "-m", "gpukit", "run", "--cpu", "--nproc", str(nproc), script, str(nproc)]
    # accelerate launches several CPU processes only through mpirun: one process is what it does alone
    if nproc == 1 and shutil.which("accelerate", path=str(Path(py).parent)) and find_spec("accelerate"):
        accelerate = str(Path(py).parent / "accelerate")
        cases["accelerate launch"] = [accelerate, "launch", "--cpu", "--num_processes", str(nproc),
                                      "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                      script, str(nproc)]
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--before-src", help="an older src/ directory: gpukit run from it runs too, interleaved")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script = str(Path(tmp) / "allreduce.py")
        Path(script).write_text(SCRIPT)
        cases: dict[str, tuple[list[str], dict[str, str]]] = {}
        for nproc in args.nproc:
            for name, cmd in _cases(script, nproc).items():
                cases[f"{nproc} proc: {name}"] = (cmd, env)
                if args.before_src and name == "gpukit run":
                    cases[f"{nproc} proc: before: {name}"] = (cmd, {**env, "PYTHONPATH": args.before_src})
        names = list(cases)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
        load_before = os.getloadavg()
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                times[name].append(_run(*cases[name]))
        load_after = os.getloadavg()
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(f"{args.reps} interleaved launches each, medians; load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    for name in names:
        base = name.split(":")[0] + ": torchrun"
        ratio = "" if name == base else f"  {wall[name] / wall[base]:.2f}x torchrun wall, {cpu[name] / cpu[base]:.2f}x CPU"
        spread = ", ".join(f"{w:.2f}" for w, _ in times[name])
        print(f"  {name:<34} {wall[name]:6.2f} s wall {cpu[name]:6.2f} s CPU{ratio}   [{spread}]")


if __name__ == "__main__":
    main()
