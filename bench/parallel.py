"""Parallel training benchmarks: each comparison measures its variants side by side in one run.

    python bench/parallel.py                # every comparison
    python bench/parallel.py split          # only the ones named (see COMPARISONS)

On a shared CPU machine run it with ``OMP_NUM_THREADS=1``: with several busy processes,
torch's spinning intra-op threads make CPU timings swing several-fold.

Comparisons:
- ``split``: median step time (forward, loss, backward, SGD step) of the unsplit model on one
  device vs ``gpukit.parallel.split`` over two stages with ``chunks=1`` (the tutorial's model
  parallelism: one stage idles while the other works) and ``chunks=4`` (GPipe micro-batches).
  With 2+ GPUs the stages are cuda:0 and cuda:1 and the chunks=4 / chunks=1 ratio is the
  pipelining gain. Without them the stages are "cpu", "cpu": nothing can overlap, so the
  figures are the overhead of splitting and micro-batching only; the ``unsplit/4`` row (the
  unsplit model run on 4 micro-batches in a plain loop) separates the cost of smaller matrix
  products from the pipeline's own.

- ``fsdp``: DDP vs FSDP (``Session(strategy=...)``) with 2 processes (``gpukit run --cpu`` on
  the CPU, ``--gpus 2`` where two GPUs are visible) on a stack of transformer layers with
  Adam (FSDP's model built on the meta device, as for a model too big for one device): per-rank bytes of parameters, gradients and optimizer state (the local tensors), the
  process's RSS and peak RSS above what it held before the model was built (plus
  ``max_memory_allocated`` on GPUs), and the median step time. Workers run with
  ``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS follows live memory (see ``compare_fsdp``). Each strategy is one launch of
  this file in worker mode (``_fsdp_worker``), back to back in one run.

To add a comparison: write ``compare_<name>(args)`` that prints its rows, and register it in
``COMPARISONS``; shared options live in ``main``'s parser.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from gpukit.accelerators import get_accelerator
from gpukit.parallel import split


def timed_steps(steps: dict[str, Callable[[], None]], sync: Callable[[], None], n: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each step function, calls interleaved (rotating order)."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(n):
        for name in names[i % len(names):] + names[: i % len(names)]:
            sync()
            start = time.perf_counter()
            steps[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# -- split: chunks=1 vs chunks=4 ---------------------------------------------------------------
def _deep_mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, by_hand: int = 1) -> Callable[[], None]:
    """One SGD step; ``by_hand=K``: the batch run as K micro-batches in a plain loop (the cost
    of smaller matrix products alone, without any pipeline)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def forward() -> torch.Tensor:
        return model(x) if by_hand == 1 else torch.cat([model(part) for part in x.tensor_split(by_hand)])

    def step() -> None:
        loss = F.cross_entropy(forward(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def compare_split(args: argparse.Namespace) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        width, depth, batch = 4096, 16, 512
    else:
        devices = [torch.device("cpu"), torch.device("cpu")]
        width, depth, batch = 256, 8, 128
    torch.manual_seed(0)
    model = _deep_mlp(width, depth)
    x = torch.randn(batch, width, device=devices[0])
    y = torch.randint(0, 10, (batch,), device=devices[-1])
    steps = {
        "unsplit": _train_step(copy.deepcopy(model).to(devices[0]), x, y.to(devices[0])),
        "unsplit/4": _train_step(copy.deepcopy(model).to(devices[0]), x, y.to(devices[0]), by_hand=4),
    }
    for chunks in (1, 4):
        split_model = split(copy.deepcopy(model), devices, chunks=chunks, verbose=False)
        steps[f"chunks={chunks}"] = _train_step(split_model, x, y)
    accelerators = [get_accelerator(d) for d in devices]
    sync = lambda: [a.synchronize(d) for a, d in zip(accelerators, devices)]  # noqa: E731
    median = timed_steps(steps, sync, args.steps, args.warmup)
    where = " + ".join(str(d) for d in devices)
    print(f"split: {depth}x Linear({width}) MLP, batch {batch}, 2 stages on {where}; "
          f"median of {args.steps} interleaved steps"
          + ("" if gpus >= 2 else " (CPU stages: overhead only, nothing overlaps)"))
    for name, seconds in median.items():
        print(f"  {name:<10} {seconds * 1e3:9.3f} ms   vs unsplit {seconds / median['unsplit']:6.3f}")
    print(f"  chunks=4 / chunks=1: {median['chunks=4'] / median['chunks=1']:.3f}"
          + ("  (< 1: the pipelining gain)" if gpus >= 2 else "")
          + f";  chunks=4 / unsplit/4 (4 micro-batches by hand, one device): "
          f"{median['chunks=4'] / median['unsplit/4']:.3f}", flush=True)


# -- fsdp: DDP vs FSDP at 2 processes -------------------------------------------------------------
FSDP_LAYERS, FSDP_WIDTH, FSDP_BATCH, FSDP_SEQ = 8, 512, 4, 32


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)


def _fsdp_worker(strategy: str, out: str, steps: int, warmup: int) -> None:
    """One rank of the fsdp comparison (started by ``gpukit run``); rank 0 writes every rank's figures."""
    import json
    import resource

    import psutil

    import gpukit

    process = psutil.Process()
    session = gpukit.Session(strategy=strategy, precision="32-true", seed=0, verbose=False)
    rss_before = process.memory_info().rss
    # FSDP as used for big models: built on the meta device, each rank allocates only its shards
    with torch.device("meta") if strategy == "fsdp" else contextlib.nullcontext():
        model = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(FSDP_WIDTH, 8, 4 * FSDP_WIDTH, dropout=0.0, batch_first=True), FSDP_LAYERS,
            enable_nested_tensor=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = session.setup(model, optimizer)
    x = torch.randn(FSDP_BATCH, FSDP_SEQ, FSDP_WIDTH, device=session.device)
    times, grads = [], 0
    for i in range(warmup + steps):
        session.barrier()
        start = time.perf_counter()
        session.backward(model(x).pow(2).mean())
        grads = _local_bytes([p.grad for p in model.parameters() if p.grad is not None])
        session.step(optimizer)
        session.accelerator.synchronize(session.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    mine = {
        "params": _local_bytes(list(model.parameters())), "grads": grads, "optimizer": _local_bytes(state),
        "rss": process.memory_info().rss - rss_before,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "gpu_peak": torch.cuda.max_memory_allocated(session.device) if session.device.type == "cuda" else None,
        "step_s": statistics.median(times),
    }
    gathered = [None] * session.world_size
    torch.distributed.all_gather_object(gathered, mine)
    if session.is_main:
        with open(out, "w") as f:
            json.dump(gathered, f)
    session.close()


def compare_fsdp(args: argparse.Namespace) -> None:
    import json
    import os
    import subprocess
    import sys
    import tempfile

    from gpukit._util.units import format_bytes

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = ["--gpus", "2"] if gpus >= 2 else ["--cpu", "--nproc", "2"]
    steps, warmup = max(3, args.steps // 3), max(1, args.warmup // 2)
    found: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            out = os.path.join(tmp, f"{strategy}.json")
            # glibc keeps freed chunks below its (self-raising, up to 32 MiB) mmap threshold in the
            # heap, so RSS would show what FSDP freed long ago; a fixed threshold makes large
            # tensors mmap'd and RSS follow live memory, for both strategies alike
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            subprocess.run([sys.executable, "-m", "gpukit", "run", *where, __file__, "_fsdp_worker", strategy, out,
                            str(steps), str(warmup)], check=True, env=env)
            with open(out) as f:
                found[strategy] = json.load(f)
    params = sum(p.numel() for p in nn.TransformerEncoderLayer(FSDP_WIDTH, 8, 4 * FSDP_WIDTH).parameters())
    print(f"fsdp: {FSDP_LAYERS}x TransformerEncoderLayer({FSDP_WIDTH}) ({FSDP_LAYERS * params / 1e6:.1f} M params), "
          f"Adam, batch {FSDP_BATCH}x{FSDP_SEQ} per rank, 2 processes ({' '.join(where)}); "
          f"median of {steps} steps; per rank (rank 0 / rank 1)")
    for strategy, ranks in found.items():
        cell = lambda key: " / ".join(format_bytes(r[key]) for r in ranks)  # noqa: E731
        gpu = f"  gpu peak {cell('gpu_peak')}" if ranks[0]["gpu_peak"] is not None else ""
        print(f"  {strategy:<5} params {cell('params')}  grads {cell('grads')}  optimizer {cell('optimizer')}  "
              f"rss +{cell('rss')}  peak rss +{cell('peak_rss')}{gpu}  step {ranks[0]['step_s'] * 1e3:.0f} ms")
    ddp, fsdp = found["ddp"][0], found["fsdp"][0]
    state = lambda r: r["params"] + r["grads"] + r["optimizer"]  # noqa: E731
    print(f"  fsdp / ddp: params+grads+optimizer {state(fsdp) / state(ddp):.3f}, peak rss "
          f"{fsdp['peak_rss'] / ddp['peak_rss']:.3f}, step time {fsdp['step_s'] / ddp['step_s']:.3f}", flush=True)


COMPARISONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "split": compare_split,
    "fsdp": compare_fsdp,
}


def main() -> None:
    import sys

    if sys.argv[1:2] == ["_fsdp_worker"]:  # one rank of compare_fsdp, started by gpukit run
        strategy, out, steps, warmup = sys.argv[2:6]
        _fsdp_worker(strategy, out, int(steps), int(warmup))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparisons", nargs="*", metavar="NAME",
                        help=f"which to run ({', '.join(COMPARISONS)}); default all")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    unknown = [name for name in args.comparisons if name not in COMPARISONS]
    if unknown:
        parser.error(f"unknown comparison(s) {', '.join(unknown)}; choose from {', '.join(COMPARISONS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)")
    for name in args.comparisons or COMPARISONS:
        COMPARISONS[name](args)


if __name__ == "__main__":
    main()
