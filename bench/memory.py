"""Memory benchmarks, measured side by side in one run.

1. Leak-watch overhead: training steps with a default ``LeakWatcher`` vs without, in
   interleaved blocks (so machine load hits both alike); median per-step time and the ratio.
2. Batch-size search: trials and accuracy of ``find_batch_size`` against every synthetic limit
   in a range (a step that raises out-of-memory above a known threshold).
3. Planner error: ``estimate_memory`` vs the measured peak (``torch.cuda.max_memory_allocated``)
   for a small CNN and a small transformer -- GPU only.

Run: ``python bench/memory.py``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from gpukit.memory import LeakWatcher, estimate_memory, measure_peak_memory, find_batch_size


def _cnn_step(batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def bench_leak_overhead(name: str, step: Callable[[], None], block: int, rounds: int) -> None:
    for _ in range(20):
        step()
    plain, watched = [], []
    watcher = LeakWatcher()  # defaults: every 10 steps, CPU heap walks rationed to 0.5%

    def plain_block() -> None:
        started = time.perf_counter()
        for _ in range(block):
            step()
        plain.append((time.perf_counter() - started) / block)

    def watched_block() -> None:
        started = time.perf_counter()
        for _ in range(block):
            step()
            watcher.step()
        watched.append((time.perf_counter() - started) / block)

    # ABBA order: whichever block runs second in a round (warmer caches, clock drift) is
    # alternated, so that bias does not land on one side of the ratio.
    for round_index in range(rounds):
        first, second = (plain_block, watched_block) if round_index % 2 == 0 else (watched_block, plain_block)
        first()
        second()
    p, w = statistics.median(plain), statistics.median(watched)
    # The watcher times its own checks: its share of the watched loop's wall time is the
    # overhead without the run-to-run noise of comparing two loops on a shared machine.
    own_share = watcher.time_in_checks_s / (sum(watched) * block)
    print(
        f"  {name:<28} step {p * 1e3:7.3f} ms   watched {w * 1e3:7.3f} ms   ratio {w / p:.4f} "
        f"(overhead {100 * (w / p - 1):+.2f}%)   time inside the watcher {100 * own_share:.2f}% of the loop   "
        f"checks {watcher.checks}, heap walks {len(watcher.samples)}, findings {len(watcher.findings)}"
    )


def _check_costs() -> tuple[float, float]:
    import sys

    from gpukit.memory._live import live_tensor_bytes

    watcher = LeakWatcher(every_n_steps=1, max_overhead=1e-9)  # heap walk only at the first check
    watcher.check()
    started = time.perf_counter()
    for _ in range(200):
        watcher._check(sys._getframe(0))
    check_s = (time.perf_counter() - started) / 200
    started = time.perf_counter()
    live_tensor_bytes("cpu")
    return check_s, time.perf_counter() - started


def bench_batch_search() -> None:
    # trials and accuracy do not depend on the full collection after each failed trial; skip its cost
    real_collect = gc.collect
    gc.collect = lambda *args: 0  # type: ignore[assignment]
    try:
        for start, limits in ((1, range(1, 128)), (8, range(8, 1024)), (1, range(1, 4097))):
            trials, errors = [], []
            for limit in limits:
                def step(batch_size: int, limit: int = limit) -> None:
                    if batch_size > limit:
                        raise torch.OutOfMemoryError("synthetic")

                result = find_batch_size(step, start=start, margin=0)
                trials.append(len(result.trials))
                errors.append((limit - result.max_fitting_batch_size) / limit)
            print(
                f"  start={start:<2} limits {limits.start}..{limits.stop - 1:<5} trials median {statistics.median(trials):.0f} "
                f"max {max(trials):>2}   error vs true max: mean {100 * statistics.mean(errors):.2f}% "
                f"max {100 * max(errors):.2f}%   within 5% in <=12 trials: "
                f"{sum(t <= 12 and e <= 0.05 for t, e in zip(trials, errors))}/{len(trials)}"
            )
    finally:
        gc.collect = real_collect  # type: ignore[assignment]


def bench_planner() -> None:
    if not torch.cuda.is_available():
        print("  skipped: no GPU")
        return
    cases = {
        "small CNN 64x3x32x32": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
            ),
            (64, 3, 32, 32),
        ),
        "transformer 4x256, 32x128": (
            lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True, dropout=0.0), 4),
            (32, 128, 256),
        ),
    }
    for name, (factory, shape) in cases.items():
        for precision in ("32-true", "bf16-mixed"):
            torch.manual_seed(0)
            model = factory()
            estimate = estimate_memory(model, "adam", torch.empty(shape), precision=precision, device="cuda")
            measured = measure_peak_memory(model, torch.randn(shape), precision=precision)
            print(
                f"  {name:<28} {precision:<10} estimated {estimate.peak_bytes / 2**20:8.1f} MiB  measured "
                f"{measured / 2**20:8.1f} MiB  error {100 * (estimate.peak_bytes / measured - 1):+.1f}%"
            )
            del model
            torch.cuda.empty_cache()


def main() -> None:
    if "--gpu-only" in sys.argv[1:]:  # make gpu-check: only the part that needs the GPU
        print("3. planner error vs measured peak")
        bench_planner()
        return
    torch.set_num_threads(1)  # steadier timings on a shared machine
    print(f"torch {torch.__version__}, {'GPU: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'}")
    print("1. leak-watch overhead at the default interval (interleaved blocks, median per-step time)")
    bench_leak_overhead("small CNN, batch 32 (CPU)", _cnn_step(32), block=100, rounds=20)
    bench_leak_overhead("small CNN, batch 4 (CPU)", _cnn_step(4), block=500, rounds=20)
    check_s, walk_s = _check_costs()
    print(f"  cost of one check (frame scan + graph test): {check_s * 1e3:.3f} ms; CPU heap walk: {walk_s * 1e3:.1f} ms "
          "(rationed to 0.5% of step time)")
    print("2. batch-size search: doubling then log-space bisection, synthetic limits")
    bench_batch_search()
    print("3. planner error vs measured peak")
    bench_planner()


if __name__ == "__main__":
    main()
