"""Session overhead: median step time of gpukit.Session vs a plain PyTorch loop.

Both loops train their own copy of the same model on the same batches; their steps are
interleaved one by one (plain, session, plain, ...) so machine noise hits both alike. A step
is: fetch the batch (and put it on the device), forward, loss, backward, optimizer step, zero
grad. Run on the CPU (an MLP and a small CNN) and on the first GPU when there is one. The
Session's step timing is on (it always is). Goal (issue 37): at most +20 us per step over plain
torch on the CPU, and no host sync and no device event in a steady step: the last lines count
them over a Session epoch with the CUDA-like fake accelerator (``gpukit.accelerators.FakeCUDAAccelerator``),
and, with a GPU, compare a plain DataLoader(pin_memory=True) with gpukit's pinned loader per batch.

On the CPU the step time is this thread's CPU time with torch on one thread (``--wall``: wall
time, torch's default threads): on a machine shared with other work, wall time mostly measures
the wait for a core. Each of ``--reps`` runs interleaves ``--steps`` steps; the overhead is the
median over runs of (Session median - plain median).

    python bench/overhead.py [--steps 300] [--warmup 30] [--reps 3] [--wall]
    python bench/overhead.py --instructions [--steps 1000]   # load-independent: CPU instructions (valgrind)

``--instructions`` counts the CPU instructions of the tiny model's loops under valgrind (cachegrind,
``--cache-sim=no``), which machine load does not change: three child processes build both loops
alike and then run ``--steps`` steps of one of them (or none); the differences give instructions
per plain step and the Session's extra instructions per step.
    python bench/overhead.py --peers [--steps 2000] [--epochs 10] [--wall]   # vs Fabric and Accelerate

``--peers`` (bench/_peers.py) reports microseconds per step and per batch for gpukit, Lightning
Fabric and Accelerate side by side (``pip install 'gpukit[bench]'`` installs the peers).

Peak memory: on a GPU, the peak allocated bytes of each loop measured in separate windows
(accelerator.memory_stats); on the CPU torch does not account allocations per loop, so
none is reported there (RSS is process-wide and shared by both loops).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpukit
from gpukit._util.units import format_bytes
from gpukit.accelerators import get_accelerator


def mlp() -> tuple[nn.Module, TensorDataset, int]:
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    return model, TensorDataset(torch.randn(4096, 784), torch.randint(0, 10, (4096,))), 64


def tiny() -> tuple[nn.Module, TensorDataset, int]:
    """A step short enough (~0.1-0.2 ms on a CPU) that the loop's own microseconds are not lost in noise."""
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, TensorDataset(torch.randn(4096, 32), torch.randint(0, 8, (4096,))), 8


def cnn() -> tuple[nn.Module, TensorDataset, int]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )
    return model, TensorDataset(torch.randn(2048, 3, 32, 32), torch.randint(0, 10, (2048,))), 32


def forever(make_iter: Callable[[], Iterator]) -> Iterator:
    while True:
        yield from make_iter()


def plain_stepper(model: nn.Module, data: TensorDataset, batch: int, device: torch.device):
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pin = device.type == "cuda"
    batches = forever(lambda: iter(DataLoader(data, batch_size=batch, shuffle=True, pin_memory=pin)))

    def step() -> None:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def session_stepper(model: nn.Module, data: TensorDataset, batch: int, device: torch.device,
                    record: str | None = None):
    """A Session step; with ``record`` (bench/record.py) it records the run and logs the loss."""
    session = gpukit.Session(devices=device, precision="32-true", verbose=False, record=record)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(data, batch_size=batch, shuffle=True, num_workers=0)
    batches = forever(lambda: iter(loader))

    def step() -> None:
        x, y = next(batches)
        with session.accumulate(model):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        session.step(optimizer)
        if record is not None:
            session.log(loss=loss.detach())

    step.session = session  # type: ignore[attr-defined]  # bench/record.py closes it
    return step


def timed(step: Callable[[], None], sync: Callable[[], None],
          clock: Callable[[], float] = time.perf_counter) -> float:
    sync()
    start = clock()
    step()
    sync()
    return clock() - start


def interleaved(a: Callable[[], None], b: Callable[[], None], steps: int, warmup: int,
                sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter,
                pairs: list[float] | None = None) -> tuple[float, float]:
    """Median step times of ``a`` and ``b``, run one step each in turn (alternating which first);
    ``pairs`` collects each pair's difference ``b - a`` (less sensitive to slow drifts in load)."""
    for _ in range(warmup):
        a()
        b()
    t_a, t_b = [], []
    for i in range(steps):
        if i % 2:
            t_a.append(timed(a, sync, clock))
            t_b.append(timed(b, sync, clock))
        else:
            t_b.append(timed(b, sync, clock))
            t_a.append(timed(a, sync, clock))
    if pairs is not None:
        pairs.extend(y - x for x, y in zip(t_a, t_b))
    return statistics.median(t_a), statistics.median(t_b)


def compare(name: str, build, device: torch.device, steps: int, warmup: int, reps: int = 1,
            clock: Callable[[], float] = time.perf_counter) -> None:
    """``reps`` interleaved runs, each with fresh loops; the two copies of the model change loops
    from one run to the next (a copy whose memory happens to be slower to reach would otherwise
    show as one loop's overhead)."""
    accelerator = get_accelerator(device)
    model, data, batch = build()
    copies = [copy.deepcopy(model), copy.deepcopy(model)]
    sync = lambda: accelerator.synchronize(device)  # noqa: E731
    runs, pairs = [], []
    for rep in range(reps):
        plain = plain_stepper(copies[rep % 2], data, batch, device)
        ours = session_stepper(copies[1 - rep % 2], data, batch, device)
        runs.append(interleaved(plain, ours, steps, warmup, sync, clock, pairs))
        if rep < reps - 1:
            ours.session.close()  # type: ignore[attr-defined]
    m_plain = statistics.median(p for p, _ in runs)
    m_ours = statistics.median(o for _, o in runs)
    extra_us = statistics.median(pairs) * 1e6
    line = (f"{name:<4} {str(device):<7} plain {m_plain * 1e3:8.3f} ms  session {m_ours * 1e3:8.3f} ms"
            f"  overhead {extra_us:+7.1f} us/step ({100 * extra_us * 1e-6 / m_plain:+.2f}%)")
    if reps > 1:
        line += "  per run: " + " ".join(f"{(o - p) * 1e6:+.1f}" for p, o in runs)
    peaks = []
    for step in (plain, ours):
        accelerator.reset_peak_memory_stats(device)
        for _ in range(10):
            step()
        peaks.append(accelerator.memory_stats(device)["peak_allocated_bytes"])
    if peaks[0] is not None:
        line += (f"  peak plain {format_bytes(peaks[0])} session {format_bytes(peaks[1])}"
                 f" ratio {peaks[1] / max(peaks[0], 1):.3f}")
    else:
        line += "  peak memory: n/a on cpu"
    print(line, flush=True)
    ours.session.close()  # type: ignore[attr-defined]


def syncs_per_steady_step() -> None:
    """A Session epoch with the CUDA-like fake accelerator: syncs and device events per step,
    steady steps (not sampled) and sampled ones apart."""
    from gpukit.accelerators import SYNC_COUNTS, FakeCUDAAccelerator

    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    model, data, batch = mlp()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = session.setup_dataloader(data, batch_size=batch, num_workers=0)
    steps = len(loader)
    counts: list[tuple[int, int]] = []
    session.timings.add_listener(lambda r: counts.append((SYNC_COUNTS.syncs, SYNC_COUNTS.events)))
    for x, y in loader:
        with session.accumulate(model):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        session.step(optimizer, clip_grad_norm=1.0)
    timings = session.timings
    sampled = {i for i in range(steps) if i < timings.sample_first or i % timings.sample_every == 0}
    deltas = [(s1 - s0, e1 - e0) for (s0, e0), (s1, e1) in zip(counts, counts[1:])]
    steady = [d for i, d in enumerate(deltas, start=1) if i not in sampled]
    rest = [d for i, d in enumerate(deltas, start=1) if i in sampled]
    print(f"syncs/events per steady step (fake CUDA accelerator, {len(steady)} steady steps of {steps}): "
          f"{sum(s for s, _ in steady) / len(steady):.3f} syncs, {sum(e for _, e in steady) / len(steady):.3f} "
          f"events; per sampled step (1 in {timings.sample_every} and the first {timings.sample_first}): "
          f"{sum(s for s, _ in rest) / len(rest):.1f} syncs, {sum(e for _, e in rest) / len(rest):.1f} event "
          f"operations", flush=True)
    session.close()


def pinned_batches(device: torch.device, epochs: int = 5) -> None:
    """Per batch, a plain DataLoader(pin_memory=True) + non_blocking copies against gpukit's loader
    (pinned through its pool), same data, epochs interleaved (a GPU only: pinning needs one)."""
    model, data, batch = mlp()
    session = gpukit.Session(devices=device, precision="32-true", verbose=False)
    ours = session.setup_dataloader(data, batch_size=batch, shuffle=True, num_workers=0)
    plain = DataLoader(data, batch_size=batch, shuffle=True, pin_memory=True)
    times: dict[str, list[float]] = {"plain": [], "gpukit": []}

    def plain_epoch() -> None:
        for x, y in plain:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def our_epoch() -> None:
        for _ in ours:
            pass

    for epoch in range(epochs + 1):
        for name, run in (("plain", plain_epoch), ("gpukit", our_epoch))[:: 1 if epoch % 2 else -1]:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            torch.cuda.synchronize(device)
            if epoch:  # the first is warm-up
                times[name].append((time.perf_counter() - start) / len(plain))
    t_plain, t_ours = statistics.median(times["plain"]), statistics.median(times["gpukit"])
    print(f"pinned batches {device}: plain DataLoader(pin_memory=True) {t_plain * 1e6:.1f} us/batch, gpukit "
          f"{t_ours * 1e6:.1f} us/batch (ratio {t_ours / t_plain:.3f}; pool {ours._move.pool})", flush=True)
    session.close()


def _steps_only(kind: str, steps: int) -> None:
    """The child of ``--instructions``: both loops built and warmed alike, then ``steps`` of one."""
    from gpukit.data import _stall

    # the loader's stall watchdog polls 10 times a second: its instructions would depend on how
    # long the run takes, not on the steps (it only reads a clock; nothing it does is per step)
    _stall._WATCH_PERIOD_S = 1e9
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, data, batch = tiny()
    device = torch.device("cpu")
    plain = plain_stepper(copy.deepcopy(model), data, batch, device)
    ours = session_stepper(copy.deepcopy(model), data, batch, device)
    for _ in range(50):
        plain()
        ours()
    step = plain if kind == "plain" else ours
    for _ in range(steps):
        step()


def instructions(steps: int) -> None:
    """Instructions per step of the tiny model's plain and Session loops (see the module docstring)."""
    import re
    import shutil
    import subprocess
    import sys

    if shutil.which("valgrind") is None:
        print("--instructions: valgrind is not installed", flush=True)
        return
    runs = {"plain0": ("plain", 0), "plain": ("plain", steps), "session": ("session", steps)}
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in every child
    procs = {name: subprocess.Popen(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", sys.executable,
         __file__, "--_child", kind, str(n)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name, (kind, n) in runs.items()}
    counts = {}
    for name, proc in procs.items():
        _, err = proc.communicate()
        found = re.search(r"I\s+refs:\s+([\d,]+)", err)
        if proc.returncode or found is None:
            print(f"--instructions: the {name} run failed:\n{err[-2000:]}", flush=True)
            return
        counts[name] = int(found.group(1).replace(",", ""))
    per_plain = (counts["plain"] - counts["plain0"]) / steps
    extra = (counts["session"] - counts["plain"]) / steps
    print(f"instructions per step, tiny model ({steps} steps, valgrind): plain {per_plain:,.0f}, Session "
          f"{per_plain + extra:,.0f}, extra {extra:+,.0f} ({100 * extra / per_plain:+.1f}%)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3, help="interleaved runs per model (median of their overheads)")
    parser.add_argument("--wall", action="store_true", help="wall time and torch's default threads on the CPU")
    parser.add_argument("--peers", action="store_true", help="per step and per batch vs Fabric and Accelerate")
    parser.add_argument("--epochs", type=int, default=10, help="--peers: epochs per loader")
    parser.add_argument("--instructions", action="store_true", help="CPU instructions per step (valgrind)")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        _steps_only(args._child[0], int(args._child[1]))
        return
    if args.instructions:
        instructions(args.steps if args.steps != 300 else 1000)
        return
    if args.peers:
        import _peers

        _peers.main(args.steps if args.steps != 300 else 2000, args.epochs, args.wall)
        return
    torch.manual_seed(0)
    if not args.wall:
        torch.set_num_threads(1)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", 0))
    load = " ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} CPUs, load {load}; "
          f"{args.reps} x {args.steps} interleaved steps per loop (median); CPU clock: "
          f"{'wall' if args.wall else 'thread CPU time'}")
    for device in devices:
        clock = time.perf_counter if args.wall or device.type != "cpu" else time.thread_time
        for name, build in (("tiny", tiny), ("mlp", mlp), ("cnn", cnn)):
            compare(name, build, device, args.steps * (10 if name == "tiny" else 1), args.warmup, args.reps, clock)
    syncs_per_steady_step()
    if torch.cuda.is_available():
        pinned_batches(torch.device("cuda", 0))


if __name__ == "__main__":
    main()
