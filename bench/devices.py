"""Benchmark of the devices layer: how fast `gpukit ls` starts, and how fast a full GPU query is.

Measured side by side in one run (interleaved, median of N):

1. wall time of `gpukit ls` on a fake spec, and on the real driver where one is present,
   against a bare `python -c pass`. Target: `gpukit ls` within 0.3 s of bare python.
2. latency of one full NVML query of all GPUs (`list_gpus()`: memory, utilization, temperature,
   power, processes of every GPU) against one `nvidia-smi --query-gpu=...` call, the tutorials'
   method. Target: at least 10x faster. Without a driver the nvidia-smi column is skipped and
   the fake's query latency is still reported.

3. ``--scale``: how `gpukit ls` and an in-process ``list_gpus()`` grow with the GPUs and processes
   of a fake spec (64, 256, 1024 GPUs x 8 processes each): time per process listed should stay
   flat (linear growth). On a machine with a real driver, the real NVML query's time per GPU too.

Run: python bench/devices.py [--runs N] [--scale]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
FAKE_SPEC = ROOT / "examples" / "fake-gpus" / "shared-4gpu.json"
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,utilization.gpu,"
             "temperature.gpu,power.draw", "--format=csv,noheader,nounits"]


def _gpukit_cmd() -> list[str]:
    script = Path(sys.executable).with_name("gpukit")
    return [str(script)] if script.exists() else [sys.executable, "-c", "from gpukit.cli import main; main()"]


def _time_cmd(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds user+sys) of one run of ``cmd``.

    CPU time is reported too because on a loaded machine wall time mostly measures the wait for
    a core; CPU time is what the command itself costs.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _median_interleaved(cases: dict[str, Callable[[], tuple[float, float]]],
                        runs: int) -> dict[str, tuple[float, float]]:
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up: page cache, .pyc files
        fn()
    for _ in range(runs):
        for name, fn in cases.items():
            samples[name].append(fn())
    return {name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
            for name, values in samples.items()}


def _real_driver_present() -> bool:
    from gpukit.devices import _nvml

    _nvml.silence_notice()  # this script reports the driver state itself
    env_fake = os.environ.pop(_nvml.FAKE_ENV, None)
    try:
        _nvml.shutdown()
        return _nvml.backend() is not None
    finally:
        if env_fake is not None:
            os.environ[_nvml.FAKE_ENV] = env_fake


def _query_latency(runs: int, fake: bool) -> float:
    """Median seconds of one list_gpus() in this (already initialised) process."""
    from gpukit.devices import FakeNvml, _nvml, list_gpus

    _nvml.shutdown()
    fake_nvml = FakeNvml(FAKE_SPEC).install() if fake else None
    try:
        list_gpus()  # initialise NVML once, as a long-running process would
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            list_gpus()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        if fake_nvml is not None:
            fake_nvml.uninstall()
        _nvml.shutdown()


def _big_spec(gpus: int, processes: int, where: Path) -> Path:
    import json

    spec = {"gpus": [{"name": "Fake GPU", "memory_total_mib": 80000, "memory_used_mib": processes * 100,
                      "processes": [{"pid": 10_000 + gpu * processes + p, "user": f"user{gpu % 7}",
                                     "command": f"python train.py --shard {p}", "used_memory_mib": 100}
                                    for p in range(processes)]} for gpu in range(gpus)]}
    path = where / f"fake-{gpus}x{processes}.json"
    path.write_text(json.dumps(spec))
    return path


def scale(runs: int) -> None:
    """`gpukit ls` and in-process ``list_gpus()`` against the size of a fake spec (and the real driver)."""
    import tempfile

    from gpukit.devices import FakeNvml, _nvml, list_gpus

    base_env = {k: v for k, v in os.environ.items() if k != "GPUKIT_FAKE_GPUS"}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"scaling: medians of {runs} runs; load average {load:.1f}")
    print("| GPUs x processes | gpukit ls wall | CPU | list_gpus() in-process (CPU) | per process listed |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in (64, 256, 1024):
            spec = _big_spec(gpus, 8, Path(tmp))
            env = {**base_env, "GPUKIT_FAKE_GPUS": str(spec)}
            cli = [_time_cmd([*_gpukit_cmd(), "ls"], env) for _ in range(runs)]
            _nvml.shutdown()
            with FakeNvml(spec):
                list_gpus()
                inproc = []
                for _ in range(runs):
                    start = time.process_time()  # CPU: what the query costs, not the wait for a core
                    list_gpus()
                    inproc.append(time.process_time() - start)
            _nvml.shutdown()
            wall, cpu = statistics.median(w for w, _ in cli), statistics.median(c for _, c in cli)
            query = statistics.median(inproc)
            print(f"| {gpus} x 8 | {wall:.2f} s | {cpu:.2f} s | {query * 1000:.0f} ms | {query / (gpus * 8) * 1e6:.1f} us |")
    if _real_driver_present():
        _nvml.shutdown()
        list_gpus()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            gpus_found = list_gpus()
            times.append(time.perf_counter() - start)
        processes = sum(len(g.processes) for g in gpus_found)
        print(f"| real NVML: {len(gpus_found)} GPU(s), {processes} process(es) | | | "
              f"{statistics.median(times) * 1000:.1f} ms | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs per case (median reported)")
    parser.add_argument("--scale", action="store_true", help="growth with the size of a fake spec (see above)")
    args = parser.parse_args()
    if args.scale:
        scale(max(3, args.runs // 5))
        return
    base_env = {k: v for k, v in os.environ.items() if k != "GPUKIT_FAKE_GPUS"}
    fake_env = {**base_env, "GPUKIT_FAKE_GPUS": str(FAKE_SPEC)}
    real = _real_driver_present()
    smi = shutil.which("nvidia-smi") is not None and real

    cases: dict[str, Callable[[], tuple[float, float]]] = {
        "python -c pass": lambda: _time_cmd([sys.executable, "-c", "pass"], base_env),
        "gpukit ls (fake, 4 GPUs)": lambda: _time_cmd([*_gpukit_cmd(), "ls"], fake_env),
    }
    if real:
        cases["gpukit ls (real driver)"] = lambda: _time_cmd([*_gpukit_cmd(), "ls"], base_env)
    if smi:
        cases["nvidia-smi --query-gpu (1 call)"] = lambda: _time_cmd(SMI_QUERY, base_env)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"devices benchmark: {args.runs} interleaved runs per case, median; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f}; real driver: {'yes' if real else 'no'}")
    walls = _median_interleaved(cases, args.runs)

    query_runs = max(args.runs * 20, 100)
    queries = {"list_gpus() on fake (4 GPUs, in-process)": _query_latency(query_runs, fake=True)}
    if real:
        queries["list_gpus() on real NVML (all GPUs, in-process)"] = _query_latency(query_runs, fake=False)

    print("\n| case | median wall time | over bare python | median CPU time (user+sys) | over bare python |")
    print("|---|---:|---:|---:|---:|")
    bare_wall, bare_cpu = walls["python -c pass"]
    for name, (wall, cpu) in walls.items():
        print(f"| {name} | {wall * 1000:.0f} ms | +{(wall - bare_wall) * 1000:.0f} ms "
              f"| {cpu * 1000:.0f} ms | +{(cpu - bare_cpu) * 1000:.0f} ms |")
    for name, seconds in queries.items():
        print(f"| {name} | {seconds * 1e6:.0f} us | | | |")

    print()
    for name in [n for n in walls if n.startswith("gpukit ls")]:
        extra_wall, extra_cpu = walls[name][0] - bare_wall, walls[name][1] - bare_cpu
        verdict = "OK" if extra_wall <= 0.3 else "MISSED"
        print(f"{name}: +{extra_wall * 1000:.0f} ms wall (+{extra_cpu * 1000:.0f} ms CPU) over bare python "
              f"(target <= 300 ms): {verdict}")
    if smi:
        ratio = walls["nvidia-smi --query-gpu (1 call)"][0] / queries["list_gpus() on real NVML (all GPUs, in-process)"]
        verdict = "OK" if ratio >= 10 else "MISSED"
        print(f"full NVML query vs one nvidia-smi call: {ratio:.0f}x faster (target >= 10x): {verdict}")
    else:
        print("nvidia-smi vs NVML: skipped (no NVIDIA driver / nvidia-smi on this machine); "
              f"the fake query takes {queries['list_gpus() on fake (4 GPUs, in-process)'] * 1e6:.0f} us.")


if __name__ == "__main__":
    main()
