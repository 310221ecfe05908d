"""Every N -> M resume of a mid-epoch checkpoint, N, M in 1..4 or 1,2,4,8 (issue 39): `gpukit run --cpu` launches.

    python bench/elastic_resume_grid.py [--strategy ddp|fsdp] [--sizes 1,2,3,4] [--micro-batch 2]
    python bench/elastic_resume_grid.py --sizes 1,2,4,8 --micro-batch 1    # the 8-rank grid

For each N: one uninterrupted N-rank run of tests/session/elastic_resume_worker.py that saves a
checkpoint mid-epoch (step 6 of 8, 24 samples into its second epoch); then, for every M != N, an M-rank
launch of the same script (the accumulation the N-rank launch chose) that resumes it. Each line says
whether every step after the switch trained on the uninterrupted run's samples (none lost, none twice:
the uninterrupted run sees each once per epoch), the accumulation the resume chose, the largest weight
difference to the uninterrupted run (0 where the sums ran in the same order) and each launch's seconds.
The global batch (24 samples) must split into micro-batches over every size: with micro-batches of 2 it
does up to 4 ranks (and 6, 12), with 1 up to 8 (and 3, 6, 12, 24).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "session" / "elastic_resume_worker.py"
sys.path.insert(0, str(WORKER.parent))
import elastic_resume_worker as worker  # noqa: E402


def launch(out: Path, tag: str, world: int, strategy: str, accumulate: int, extra: list[str]) -> float:
    """One launch; its wall seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", str(world), str(WORKER), str(out), tag,
           strategy, str(accumulate), *extra]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def step_ids(out: Path, tag: str, world: int) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for rank in range(world):
        for step, ids in json.loads((out / f"{tag}-{rank}.json").read_text())["steps"].items():
            steps.setdefault(step, []).extend(ids)
    return {step: sorted(ids) for step, ids in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    parser.add_argument("--sizes", default="1,2,3,4")
    parser.add_argument("--micro-batch", type=int, default=worker.MICRO_BATCH)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    micro = args.micro_batch
    unfit = [n for n in sizes if n < 1 or worker.GLOBAL_BATCH % (micro * n)]
    if unfit:
        parser.error(f"--sizes {args.sizes}: the global batch of {worker.GLOBAL_BATCH} does not split into "
                     f"micro-batches of {micro} over {unfit} rank(s); choose sizes that divide "
                     f"{worker.GLOBAL_BATCH // micro}, or a smaller --micro-batch")
    save_at = 6
    print(f"strategy {args.strategy}; {worker.SAMPLES} samples, global batch {worker.GLOBAL_BATCH}, "
          f"micro-batch {micro}, checkpoint at step {save_at} of {worker.EPOCHS * 4} (mid-epoch)")
    print(f"{'N->M':>6} {'same samples':>13} {'accumulate':>11} {'max |dw|':>10} {'full s':>7} {'resume s':>9}")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for n in sizes:
            accumulate = worker.GLOBAL_BATCH // (micro * n)
            batch = ["--micro-batch", str(micro)]
            full_s = launch(out, f"full{n}", n, args.strategy, accumulate,
                            ["--save", f"{out / f'ckpt{n}'}:{save_at}", *batch])
            full_ids = step_ids(out, f"full{n}", n)
            reference = torch.load(out / f"full{n}.pt")["weights"]
            for m in sizes:
                if m == n:
                    continue
                tag = f"r{n}to{m}"
                resume_s = launch(out, tag, m, args.strategy, accumulate, ["--resume", str(out / f"ckpt{n}"), *batch])
                ids = step_ids(out, tag, m)
                same = sorted(ids) == [str(s) for s in range(save_at + 1, worker.EPOCHS * 4 + 1)] and all(
                    ids[s] == full_ids[s] for s in ids)
                chosen = json.loads((out / f"{tag}-0.json").read_text())["accumulate"]
                weights = torch.load(out / f"{tag}.pt")["weights"]
                diff = max(float((weights[k] - v).abs().max()) for k, v in reference.items())
                bad += (not same) or diff > 1e-4
                print(f"{n:>3}->{m:<2} {str(same):>13} {accumulate:>5} -> {chosen:<3} {diff:>10.2e} "
                      f"{full_s:>7.1f} {resume_s:>9.1f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if bad:
        raise SystemExit(f"{bad} switch(es) lost or repeated samples or ended with other weights")


if __name__ == "__main__":
    main()
