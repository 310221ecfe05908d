"""Benchmark: gpukit.save / gpukit.load vs plain torch.save / torch.load on a ~1 GiB state.

    python bench/checkpoint.py [--size-mib 1024] [--reps 5] [--dir DIR]

Both sides write into the same temporary directory, repetitions are interleaved (the order
alternates each round) and medians are reported. The ratio is plain time / gpukit time
(>= 0.9 means gpukit's safety costs at most 10%). gpukit's save does more work on purpose:
it writes a temp file, fsyncs it, renames it and fsyncs the directory; plain torch.save leaves
the data in the page cache. The time gpukit's save spends inside fsync is measured too and
reported, so the cost of durability itself is visible.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

import gpukit


def _state(size_mib: int) -> dict[str, torch.Tensor]:
    per_tensor = 16 * 1024 * 1024 // 4  # 16 MiB of float32 each, like the layers of a mid-size model
    return {f"layers.{i}.weight": torch.randn(per_tensor) for i in range(max(1, size_mib // 16))}


def _time(fn: Callable[[], object]) -> float:
    # Flush everything first (untimed): torch.save leaves its file as dirty pages, and without
    # this the kernel writes them back during whichever operation comes next.
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = parser.parse_args()
    state = _state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {k: [] for k in ("torch.save", "gpukit.save", "torch.load", "gpukit.load")}
    fsync_s: list[float] = []
    real_fsync = os.fsync

    def timed_fsync(fd: int) -> None:
        start = time.perf_counter()
        real_fsync(fd)
        fsync_s[-1] += time.perf_counter() - start

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        plain, safe = Path(tmp) / "plain.pt", Path(tmp) / "safe.pt"

        def gpukit_save() -> None:
            fsync_s.append(0.0)
            with mock.patch("os.fsync", timed_fsync):
                gpukit.save(state, safe)

        saves = [("torch.save", lambda: torch.save(state, plain)), ("gpukit.save", gpukit_save)]
        loads = [("torch.load", lambda: torch.load(plain, weights_only=True)), ("gpukit.load", lambda: gpukit.load(safe))]
        for rep in range(args.reps):
            for name, fn in saves if rep % 2 == 0 else saves[::-1]:
                times[name].append(_time(fn))
            for name, fn in loads if rep % 2 == 0 else loads[::-1]:
                times[name].append(_time(fn))
        assert os.path.getsize(safe) >= nbytes
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: {nbytes / 2**30:.2f} GiB in {len(state)} tensors, {args.reps} interleaved repetitions, medians")
    for name, value in median.items():
        samples = " ".join(f"{t:.2f}" for t in times[name])
        print(f"  {name:<24} {value:7.3f} s   ({nbytes / 2**20 / value:7.0f} MiB/s)   samples: {samples}")
    fsync_median = statistics.median(fsync_s)
    print(f"  of which fsync (inside gpukit.save) {fsync_median:.3f} s "
          f"({100 * fsync_median / median['gpukit.save']:.0f}% of gpukit.save)")
    print(f"save ratio (torch.save / gpukit.save): {median['torch.save'] / median['gpukit.save']:.2f}")
    print(f"load ratio (torch.load / gpukit.load): {median['torch.load'] / median['gpukit.load']:.2f}")

if __name__ == "__main__":
    main()
