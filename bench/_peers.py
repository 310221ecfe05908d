"""``bench/overhead.py --peers``: per-step and per-batch cost of gpukit, Fabric and Accelerate.

Per step: each tool trains its own copy of the same model on one fixed batch (no data
loading), written the way its documentation shows; the steps of all tools are interleaved one
by one (the order rotates) and the overhead is the median step time minus plain PyTorch's.
A tiny model makes the framework's own microseconds visible; the MLP of issue 18 puts them
against a real step. Per batch: one epoch over an in-memory TensorDataset through each
tool's loader, epochs interleaved, medians per batch, ratio to torch's DataLoader.

Times are this thread's CPU time (``time.thread_time``) with torch on one thread: on a machine
busy with other work, wall time mostly measures the wait for a core (and torch's intra-op
threads spinning against other processes), while the CPU time of the work itself is what the
frameworks add. ``--wall`` reports wall time instead (for an idle machine).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpukit

Step = Callable[[], None]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _gpukit(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def step() -> None:
        with session.accumulate(model):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        session.step(optimizer)

    return step


def _fabric(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def step() -> None:
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _accelerate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def step() -> None:
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step


STEPPERS = {"plain": _plain, "gpukit": _gpukit, "fabric": _fabric, "accelerate": _accelerate}
_NEEDS = {"fabric": "lightning", "accelerate": "accelerate"}


def available_tools() -> list[str]:
    return [t for t in STEPPERS if t not in _NEEDS or _installed(_NEEDS[t])]


CLOCK = time.thread_time


def per_step(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, float]:
    """Median step time (s) per tool, steps interleaved."""
    tools = available_tools()
    steppers = {t: STEPPERS[t](copy.deepcopy(model), x, y) for t in tools}
    for _ in range(max(20, steps // 20)):  # warm-up
        for fn in steppers.values():
            fn()
    times: dict[str, list[float]] = {t: [] for t in tools}
    clock = CLOCK
    for i in range(steps):
        order = tools[i % len(tools):] + tools[: i % len(tools)]
        for tool in order:
            start = clock()
            steppers[tool]()
            times[tool].append(clock() - start)
    return {t: statistics.median(v) for t, v in times.items()}


def _loaders(data: TensorDataset, batch: int) -> dict[str, object]:
    tools = available_tools()
    out: dict[str, object] = {"torch": DataLoader(data, batch_size=batch, shuffle=True)}
    session = gpukit.Session(devices="cpu", verbose=False)
    out["gpukit"] = session.setup_dataloader(data, batch_size=batch, shuffle=True, num_workers=0)
    if "fabric" in tools:
        from lightning.fabric import Fabric

        out["fabric"] = Fabric(accelerator="cpu", devices=1).setup_dataloaders(
            DataLoader(data, batch_size=batch, shuffle=True))
    if "accelerate" in tools:
        from accelerate import Accelerator

        out["accelerate"] = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=batch, shuffle=True))
    return out


def per_batch(data: TensorDataset, batch: int, epochs: int) -> dict[str, float]:
    """Median time per batch (s) of a whole epoch through each tool's loader, epochs interleaved."""
    loaders = _loaders(data, batch)
    names = list(loaders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for e in range(epochs + 2):
        order = names[e % len(names):] + names[: e % len(names)]
        for name in order:
            count = 0
            start = CLOCK()
            for _ in loaders[name]:  # type: ignore[attr-defined]
                count += 1
            if e >= 2:  # two warm-up epochs
                times[name].append((CLOCK() - start) / count)
    return {n: statistics.median(v) for n, v in times.items()}


def main(steps: int, epochs: int, wall: bool = False) -> None:
    global CLOCK
    CLOCK = time.perf_counter if wall else time.thread_time
    warnings.filterwarnings("ignore", message=".*srun.*")  # Lightning's hint on a SLURM host
    torch.manual_seed(0)
    torch.set_num_threads(1)
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    tools = available_tools()
    missing = [t for t in STEPPERS if t not in tools]
    print(f"torch {torch.__version__}, 1 thread, {'wall' if wall else 'thread CPU'} time, load average {load}"
          + (f"; not installed: {', '.join(missing)} (pip install 'gpukit[bench]')" if missing else ""))
    cases = (
        ("tiny Linear(32,32)", nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)),
         torch.randn(16, 32), 16),
        ("MLP 784-256-256-10", nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                             nn.Linear(256, 10)), torch.randn(64, 784), 64),
    )
    print(f"\nper step ({steps} interleaved steps per tool on the tiny model, {max(100, steps // 4)} on the MLP; "
          "median; overhead = tool - plain):")
    print(f"  {'model':<20} {'plain':>9} " + " ".join(f"{t:>20}" for t in tools if t != "plain"))
    for (name, model, x, n), count in zip(cases, (steps, max(100, steps // 4))):
        y = torch.randint(0, 10, (n,))
        med = per_step(name, model, x, y, count)
        cells = [f"{1e6 * (med[t] - med['plain']):+7.1f} us {100 * (med[t] / med['plain'] - 1):+6.1f}%"
                 for t in tools if t != "plain"]
        print(f"  {name:<20} {1e6 * med['plain']:7.1f}us " + " ".join(f"{c:>20}" for c in cells))
    data = TensorDataset(torch.randn(8192, 784), torch.randint(0, 10, (8192,)))
    med = per_batch(data, 64, epochs)
    print(f"\nper batch (in-memory TensorDataset 8192x784, batch 64; {epochs} interleaved epochs, median):")
    for name, value in med.items():
        print(f"  {name:<11} {1e6 * value:8.1f} us/batch  {value / med['torch']:.3f}x torch "
              f"({1e6 * (value - med['torch']):+.1f} us)")
    print("\nload average after: " + " ".join(f"{v:.1f}" for v in os.getloadavg()))
