"""A job wanting 4 GPUs against a stream of 1-GPU jobs on a fake 4-GPU box (issue 26).

    python bench/fair_queue.py                     # this checkout's gpukit
    python bench/fair_queue.py --src /other/src    # another gpukit (e.g. before the fair queue)

Four 1-GPU jobs run (each JOB_S long, started a quarter of a job apart); then a 4-GPU job starts
waiting; then a new 1-GPU job arrives every eighth of a job length, STREAM of them (twice as many
as the 4 GPUs can serve, so 1-GPU jobs are always waiting). Every job is
a real process calling only the public ``claim_gpus(n, wait=True)``. Prints how long the 4-GPU job
waited and how many 1-GPU jobs that came after it started before it. With a fair queue it starts
as soon as the jobs that ran when it came have ended (at most one job length); with polling it
waits until the stream dries up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _job(name: str, count: int, hold_s: float, log: str) -> None:
    from gpukit.devices import claim_gpus

    asked = time.time()
    with claim_gpus(count, wait=True, timeout_s=600, poll_interval_s=0.05):
        started = time.time()
        time.sleep(hold_s)  # the job's work
        ended = time.time()
    with open(log, "a") as out:
        out.write(json.dumps({"name": name, "asked": asked, "start": started, "end": ended}) + "\n")


def _spawn(name: str, count: int, hold_s: float, log: str) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _job(name, count, hold_s, log)
        finally:
            os._exit(0)
    return pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--job-s", type=float, default=2.0)
    parser.add_argument("--stream", type=int, default=24)
    args = parser.parse_args()
    sys.path.insert(0, args.src)
    work = Path(tempfile.mkdtemp(prefix="gpukit-queue-bench-"))
    spec = work / "four.json"
    spec.write_text(json.dumps({"gpus": [{"name": "Fake A100", "uuid": f"GPU-{i}bbbbbbb-0000-4000-8000-00000000000{i}",
                                          "memory_total_mib": 40960, "memory_used_mib": 0} for i in range(4)]}))
    os.environ.update({"GPUKIT_FAKE_GPUS": str(spec), "GPUKIT_CLAIM_DIR": str(work / "claims")})
    import gpukit.devices  # noqa: F401 - from --src, before the forks

    log, pids, quarter = str(work / "log.jsonl"), [], args.job_s / 4
    try:
        for i in range(4):
            pids.append(_spawn(f"early{i}", 1, args.job_s, log))
            time.sleep(quarter)  # arrivals, not synchronisation
        big_asked = time.time()
        pids.append(_spawn("big", 4, args.job_s, log))
        for i in range(args.stream):
            time.sleep(quarter / 2)
            pids.append(_spawn(f"late{i}", 1, args.job_s, log))
        for pid in pids:
            os.waitpid(pid, 0)
        rows = [json.loads(line) for line in Path(log).read_text().splitlines()]
        if os.environ.get("QUEUE_BENCH_TRACE"):
            for r in sorted(rows, key=lambda r: r["start"]):
                print(f"{r['name']:>8} asked {r['asked'] - big_asked:+.2f} started {r['start'] - big_asked:+.2f}")
        big = next(r for r in rows if r["name"] == "big")
        # "later" by the time each job asked (on a loaded machine a job forked later may ask first);
        # overtakers are listed with how much later they asked
        ahead = sorted(r["asked"] - big["asked"] for r in rows
                       if r["asked"] > big["asked"] and r["start"] < big["start"])
        overtook = len(ahead)
        later = sum(1 for r in rows if r["asked"] > big["asked"])
        older = max(r["end"] for r in rows if r["asked"] < big["asked"])  # the jobs that came before it
        print(f"gpukit from {args.src}")
        print(f"4-GPU job waited {big['start'] - big['asked']:.2f} s, {big['start'] - older:.2f} s after the jobs "
              f"that came before it had ended (one job is {args.job_s:g} s); {overtook} of {later} later "
              f"1-GPU jobs started before it{' (asked ' + ', '.join(f'{d:+.2f}' for d in ahead[:6]) + ' s after it)' if ahead else ''}; "
              f"load average {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
