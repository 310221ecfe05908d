"""The SLURM battery of bench/preemption.py: ``--trials`` jobs per documented way on the real
2-node cluster, each warned at a moment drawn from start-up, worker start, training, save and
teardown (tests/cluster/slurm_trials.py runs and judges one), then a table: where it landed, how
often it was requeued, its final state, bit-exact weights, processes left behind.
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from slurm_helpers import SCRIPT  # tests/cluster, put on sys.path by bench/preemption.py
from slurm_trials import MOMENTS, SPREAD_S, Cluster, as_expected, reference, table, trial


def run_slurm(trials: int, ways: list[str], parallel: int = 2, seed: int = 1729) -> int:
    directory = Path(tempfile.mkdtemp(prefix="gpukit-bench-slurm-"))
    started = subprocess.run([str(SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        print(f"no SLURM cluster: {started.stderr.strip()[-300:]}")
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cluster = Cluster({**env, "SLURM_CONF": str(directory / "slurm.conf")})
    rng = random.Random(seed)
    results: list[dict] = []
    try:
        references = {way: reference(cluster, way, directory / f"reference-{i}") for i, way in enumerate(ways)}
        plan = [(way, MOMENTS[i % len(MOMENTS)]) for way in ways for i in range(trials)]
        with ThreadPoolExecutor(parallel) as pool:
            futures = [pool.submit(trial, cluster, way, moment, round(rng.uniform(0, SPREAD_S[moment]), 2),
                                   references[way], directory / f"trial-{i}") for i, (way, moment) in enumerate(plan)]
            for future in futures:
                r = future.result()
                results.append(r)
                print(f"{r['way']:11s} {r['moment']:12s} +{r['delay_s']:4.2f} s landed: {r['landed']:21s} "
                      f"requeues {r['requeues']} {r['state']:14s} bit-exact={r['exact']!s:5} left {r['left']} "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
                if not as_expected(r):
                    print(r["tail"], flush=True)
    finally:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=120)
    table(results)
    return 0 if all(as_expected(r) for r in results) else 1
