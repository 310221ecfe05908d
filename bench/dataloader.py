"""Data loading: tuned loader settings vs torch's defaults and Lightning's rule, side by side.

Two datasets -- one whose ``__getitem__`` does real CPU work (decode/augment-like numpy ops on
synthetic uint8 images) and one in memory (a TensorDataset) -- each trained with a small model
for the same time under three loader settings:

* torch defaults: ``num_workers=0``;
* Lightning's rule: ``num_workers = max(1, CPUs // processes - 1)`` (its "does not have many
  workers" suggestion);
* gpukit tuned: ``gpukit.data.tune_loader`` (what ``num_workers="tune"`` does), tuning time
  reported against a 10-minute run.

Then the step-time breakdown's data-wait share against the truth measured by instrumenting the
dataset (time inside ``__getitem__`` and ``collate_fn``), the breakdown's cost per step against
the CPU MLP step of ``bench/overhead.py``, and on a GPU pinned vs pageable copies.

    python bench/dataloader.py [--seconds 6] [--rounds 2] [--tune-budget 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

import gpukit
from gpukit.data import StepTimings, tune_loader
from gpukit.data._workers import usable_cpu_count

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402  -- the CPU MLP and the session-vs-plain comparison

RUN_S = 600.0  # the "10-minute run" tuning time is compared with


class DecodeAugment(Dataset):
    """Synthetic uint8 images; each item is cropped, flipped, blurred and normalised in numpy."""

    def __init__(self, n: int = 2048, size: int = 96, crop: int = 64) -> None:
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=n)
        self.crop = crop
        self.getitem_s = 0.0  # instrumentation: time inside __getitem__ (main process only)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        start = time.perf_counter()
        img = self.images[i]
        y0, x0 = (i * 7) % (img.shape[0] - self.crop), (i * 13) % (img.shape[1] - self.crop)
        img = img[y0:y0 + self.crop, x0:x0 + self.crop].astype(np.float32)
        if i % 2:
            img = img[:, ::-1]
        for _ in range(4):  # a 3x3 box blur, four times: the "decode" cost
            pad = np.pad(img, ((1, 1), (1, 1), (0, 0)), mode="edge")
            img = sum(pad[dy:dy + self.crop, dx:dx + self.crop] for dy in range(3) for dx in range(3)) / 9.0
        img = (img - img.mean(axis=(0, 1))) / (img.std(axis=(0, 1)) + 1e-6)
        out = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        self.getitem_s += time.perf_counter() - start
        return out, int(self.labels[i])


def in_memory() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(8192, 3, 32, 32, generator=g), torch.randint(0, 10, (8192,), generator=g))


def model_for(dataset: Dataset) -> nn.Module:
    x, _ = dataset[0]
    return nn.Sequential(nn.Flatten(), nn.Linear(x.numel(), 256), nn.ReLU(), nn.Linear(256, 10))


def train_step(dataset: Dataset) -> Callable[[Any], None]:
    """One SGD step of a fresh model on a batch: the loop's work, and tune_loader's step_fn."""
    torch.manual_seed(0)
    model = model_for(dataset)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch: Any) -> None:
        x, y = batch
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def train_for(dataset: Dataset, batch_size: int, loader_kwargs: dict[str, Any], seconds: float) -> float:
    """Samples/s of a training loop over a DataLoader with ``loader_kwargs`` (warm-up excluded)."""
    step = train_step(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, **loader_kwargs)
    samples, start, warm = 0, None, 3
    deadline = None
    while True:
        for i, (x, y) in enumerate(loader):
            step((x, y))
            now = time.perf_counter()
            if start is None:
                if i + 1 >= warm:
                    start, deadline = now, now + seconds
                continue
            samples += len(x)
            if now >= deadline:  # type: ignore[operator]
                return samples / (now - start)


def compare_settings(args: argparse.Namespace) -> None:
    lightning = max(1, usable_cpu_count() - 1)
    print(f"\n== loader settings ({usable_cpu_count()} usable CPUs, {args.seconds:g} s per run, "
          f"{args.rounds} rounds, samples/s) ==")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["GPUKIT_CACHE_DIR"] = cache  # measure the tuning, not a cached answer
        for name, dataset, batch in (("decode+augment", DecodeAugment(), 32),
                                     ("in-memory", in_memory(), 64)):
            start = time.perf_counter()
            alone = tune_loader(dataset, batch, time_budget_s=args.tune_budget, verbose=False)
            alone_s = time.perf_counter() - start
            start = time.perf_counter()  # with the step: what the loop will see
            tuned = tune_loader(dataset, batch, step_fn=train_step(dataset),
                                time_budget_s=args.tune_budget, verbose=False)
            tune_s = time.perf_counter() - start
            configs = {
                "torch default (num_workers=0)": {},
                f"Lightning rule (num_workers={lightning})": {"num_workers": lightning},
                f"gpukit tuned, loader alone ({alone.settings.short()})": alone.settings.as_kwargs(),
                f"gpukit tuned with step_fn ({tuned.settings.short()})": tuned.settings.as_kwargs(),
            }
            rates: dict[str, list[float]] = {k: [] for k in configs}
            for r in range(args.rounds):  # alternate the order so drift hits all alike
                for label in (list(configs) if r % 2 == 0 else list(reversed(configs))):
                    rates[label].append(train_for(dataset, batch, configs[label], args.seconds))
            means = {k: statistics.mean(v) for k, v in rates.items()}
            best_other = max(v for k, v in means.items() if not k.startswith("gpukit"))
            print(f"{name}:")
            for label, rate in means.items():
                print(f"  {label:<58} {rate:9.1f}")
            for key, took in (("loader alone", alone_s), ("with step_fn", tune_s)):
                ours = means[next(k for k in means if key in k)]
                print(f"  tuned {key}: / best other {ours / best_other:.3f}, / num_workers=0 "
                      f"{ours / means['torch default (num_workers=0)']:.3f}; tuning {took:.1f} s = "
                      f"{100 * took / RUN_S:.2f}% of a 10-minute run")


def breakdown_accuracy(args: argparse.Namespace) -> None:
    print("\n== data-wait share: breakdown vs instrumented dataset (num_workers=0) ==")
    for label, compute_ms in (("data-bound", 0.0), ("mixed", 15.0)):
        dataset = DecodeAugment(n=512)
        collate_s = [0.0]

        def collate(items: list[Any]) -> Any:
            start = time.perf_counter()
            out = default_collate(items)
            collate_s[0] += time.perf_counter() - start
            return out

        session = gpukit.Session(devices="cpu", verbose=False)
        loader = session.setup_dataloader(dataset, batch_size=32, num_workers=0, collate_fn=collate)
        start = time.perf_counter()
        for _ in loader:
            if compute_ms:
                torch.randn(256, 256) @ torch.randn(256, 256)
                time.sleep(compute_ms / 1e3)
        wall = time.perf_counter() - start
        truth = (dataset.getitem_s + collate_s[0]) / wall
        measured = session.throughput().data_share
        print(f"  {label:<11} truth {100 * truth:5.1f}%  breakdown {100 * measured:5.1f}%  "
              f"difference {100 * abs(measured - truth):4.1f} points")


def timing_cost(args: argparse.Namespace) -> None:
    print("\n== cost of the breakdown per step vs the CPU MLP step of bench/overhead.py ==")
    batches = [(torch.zeros(64, 784), torch.zeros(64))] * 20000
    timings = StepTimings()
    listener_calls = []
    with_listener = StepTimings()
    with_listener.add_listener(listener_calls.append)
    costs: dict[str, list[float]] = {"plain": [], "timed": [], "timed+listener": []}
    for _ in range(5):
        for label, iterate in (("plain", lambda: iter(batches)),
                               ("timed", lambda: timings.iterate(batches, epoch=0)),
                               ("timed+listener", lambda: with_listener.iterate(batches, epoch=0))):
            start = time.thread_time()  # CPU time of this thread: robust on a loaded machine
            for _batch in iterate():
                pass
            costs[label].append((time.thread_time() - start) / len(batches))
        listener_calls.clear()
    plain = min(costs["plain"])
    model, data, batch = overhead.mlp()
    step = overhead.plain_stepper(model, data, batch, torch.device("cpu"))
    for _ in range(20):
        step()
    step_s = statistics.median(overhead.timed(step, lambda: None) for _ in range(200))
    for label in ("timed", "timed+listener"):
        cost = min(costs[label]) - plain
        print(f"  {label:<15} {cost * 1e6:6.2f} us/step (thread CPU) = {100 * cost / step_s:.3f}% of "
              f"the MLP step measured now ({step_s * 1e3:.3f} ms wall)")
    print("  end to end (bench/overhead.py's interleaved loops, session includes the breakdown):")
    overhead.compare("mlp", overhead.mlp, torch.device("cpu"), 300, 30)


def pinned_vs_pageable(args: argparse.Namespace) -> None:
    print("\n== GPU: host-to-device copy share, pinned vs pageable (exact timings) ==")
    dataset = TensorDataset(torch.randn(2048, 3, 224, 224), torch.randint(0, 10, (2048,)))
    for pin in (False, True):
        session = gpukit.Session(devices="cuda:0", verbose=False)
        session.timings.exact = True
        loader = session.setup_dataloader(dataset, batch_size=64, num_workers=0, pin_memory=pin)
        for x, _ in loader:
            x.float().mean()
        s = session.throughput()
        print(f"  pin_memory={pin!s:<5} copy {1e3 * (s.h2d_s or 0) / max(s.steps, 1):7.2f} ms/batch "
              f"({100 * (s.h2d_share or 0):4.1f}% of step), {s.samples_per_s or 0:9.1f} samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="training time per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tune-budget", type=float, default=6.0)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"{usable_cpu_count()} usable CPUs")
    compare_settings(args)
    breakdown_accuracy(args)
    timing_cost(args)
    if torch.cuda.is_available():
        pinned_vs_pageable(args)


if __name__ == "__main__":
    main()
