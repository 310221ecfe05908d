"""`gpukit report` on big records: seconds, peak memory (RSS) and HTML size, old reader against new.

Builds the big hostile records of tests/hostile/corpus_records.py once (streamed to disk), then
reports each with every given source tree, interleaved (A, B, A, B ...) so machine load hits
both alike. Each report runs in a fresh process; its peak RSS comes from getrusage of that one
child, and its CPU time (user + system: less sensitive to a busy machine than wall time).

    python bench/report_limits.py OLD_SRC NEW_SRC [--timeout 600] [--only steps_1m_lines ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "hostile"))
from corpus_records import PROBES  # noqa: E402

RECORDS = ("event_kind_200mb", "scalar_key_200mb", "steps_1m_lines", "rank_files_100k")
_CHILD = """
import resource, subprocess, sys, time
start = time.monotonic()
try:
    proc = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))
    code = proc.returncode
except subprocess.TimeoutExpired:
    code = "timeout"
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(code, round(time.monotonic() - start, 2), round(usage.ru_utime + usage.ru_stime, 2), usage.ru_maxrss)
"""


def measure(src: str, directory: Path, out: Path, timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": src}
    out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(timeout_s), sys.executable, "-m", "gpukit", "report",
                           str(directory), "--out", str(out)], env=env, capture_output=True, text=True)
    code, seconds, cpu_s, rss_kib = proc.stdout.split()
    size = f"{out.stat().st_size / 2**20:,.2f} MB" if out.exists() else "none"
    return (f"exit {code}, {float(seconds):,.1f} s wall, {float(cpu_s):,.1f} s CPU, "
            f"peak RSS {int(rss_kib) / 2**10:,.0f} MiB, HTML {size}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sources", nargs="+", help="source trees (PYTHONPATH) to compare, e.g. old/src new/src")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--only", nargs="*", default=list(RECORDS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            started = time.monotonic()
            (Path(tmp) / name).mkdir()
            run = PROBES[name](Path(tmp) / name)
            directory = Path(run.argv[1])
            print(f"{name}: built in {time.monotonic() - started:.0f} s", flush=True)
            for src in args.sources:
                print(f"  {src}: {measure(src, directory, Path(tmp) / 'report.html', args.timeout)}", flush=True)
            subprocess.run(["rm", "-rf", str(Path(tmp) / name)], check=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
