"""The measurements of ``gpukit doctor --gpu``, run in a child process per GPU.

``python -m gpukit.doctor._gpu_probe gpu --index N`` measures ``cuda:0`` of a process that sees
one GPU (the parent sets ``CUDA_VISIBLE_DEVICES`` to its UUID) and prints one JSON object:
host-to-device and device-to-host copy bandwidth from pinned and from pageable memory, a large
matrix product's TFLOP/s, device memory bandwidth (a large device-to-device copy), the memory a
process can allocate, and what NVML says while the GPU is
busy (the PCIe link trains down when idle, clock-event reasons change under load).
``... allreduce --world N`` times an all-reduce over N GPUs (NCCL; gloo on the CPU in tests).

A child process per GPU keeps CUDA out of the doctor's own process and lets a hung GPU be
stopped by a time limit. Every function takes its device, so the suite runs them on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

__all__ = ["measure_copies", "measure_matmul", "measure_device_memory", "measure_allocatable", "measure_allreduce",
           "main"]

_GIB = 2**30


def _times(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn``, after one warm-up run."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _timed(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, after one warm-up run."""
    return statistics.median(_times(fn, sync, reps))


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_copies(device: torch.device, size_bytes: int = 256 * 2**20, reps: int = 10,
                   during: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Copy bandwidth in GB/s (10^9 bytes/s): host->device and device->host, pinned and pageable.

    Pinned copies give their median and their sustained minimum (``*_min_gbps``: the slowest of
    ``reps`` copies, what the floors judge: a link that dips is not saved by its best copy).
    ``during()`` is called while pinned host->device copies are in flight (to read the PCIe link
    under load); its result is returned as ``"during"``.
    """
    numel = size_bytes // 4
    pageable = torch.empty(numel, dtype=torch.float32)
    pageable.fill_(1.0)  # touch the pages: a first-touch fault is not a copy
    pinned = pageable.pin_memory() if device.type == "cuda" else pageable
    target = torch.empty(numel, dtype=torch.float32, device=device)
    sync = _sync(device)
    gb = size_bytes / 1e9
    out: dict[str, Any] = {"size_bytes": size_bytes}
    h2d = _times(lambda: target.copy_(pinned, non_blocking=True), sync, reps)
    out["h2d_pinned_gbps"], out["h2d_pinned_min_gbps"] = gb / statistics.median(h2d), gb / max(h2d)
    out["h2d_pageable_gbps"] = gb / _timed(lambda: target.copy_(pageable), sync, max(3, reps // 2))
    d2h = _times(lambda: pinned.copy_(target, non_blocking=True), sync, reps)
    out["d2h_pinned_gbps"], out["d2h_pinned_min_gbps"] = gb / statistics.median(d2h), gb / max(d2h)
    if during is not None:
        for _ in range(8):  # queue a few copies (tens of ms), then look at the link while they run
            target.copy_(pinned, non_blocking=True)
        out["during"] = during()
        sync()
    return out


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int = 8192, seconds: float = 1.0,
                   during: Callable[[], Any] | None = None, windows: int = 5) -> dict[str, Any]:
    """TFLOP/s of ``n x n @ n x n`` products in ``dtype`` over about ``seconds`` (clocks ramp up first).

    The time is cut into ``windows`` equal runs of products: ``tflops`` is the whole, ``tflops_min``
    the slowest window (the sustained minimum: a GPU that throttles after a burst shows there).
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = _sync(device)
    one = _timed(lambda: a @ b, sync, 3)
    per_window = max(3, int(seconds / windows / max(one, 1e-6)))
    observed = None
    took = []
    for window in range(windows):
        sync()
        start = time.perf_counter()
        for _ in range(per_window):
            a @ b
        if window == windows // 2 and during is not None:
            observed = during()  # read while the products still run
        sync()
        took.append(time.perf_counter() - start)
    flops = 2 * n**3 * per_window
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "reps": per_window * windows,
            "tflops": flops * windows / sum(took) / 1e12, "tflops_min": flops / max(took) / 1e12,
            "during": observed}


def measure_device_memory(device: torch.device, size_bytes: int = 2 * _GIB, reps: int = 10) -> dict[str, Any]:
    """Device memory bandwidth in GB/s: a large device-to-device copy (each byte read once, written once).

    Counted as nvbandwidth and STREAM's copy do: 2 x ``size_bytes`` moved per copy. ``gbps`` is the
    median, ``min_gbps`` the slowest copy (the sustained minimum).
    """
    numel = size_bytes // 4
    source = torch.empty(numel, dtype=torch.float32, device=device)
    source.fill_(1.0)
    target = torch.empty_like(source)
    times = _times(lambda: target.copy_(source), _sync(device), reps)
    moved_gb = 2 * size_bytes / 1e9
    return {"size_bytes": size_bytes, "gbps": moved_gb / statistics.median(times), "min_gbps": moved_gb / max(times)}


def measure_allocatable(device: torch.device, limit_bytes: int, chunk_bytes: int = _GIB) -> int:
    """Bytes one process can allocate on ``device`` in ``chunk_bytes`` blocks, up to ``limit_bytes``.

    Stops at the first out-of-memory (or at the limit), then frees everything it took.
    """
    held = []
    total = 0
    try:
        while total + chunk_bytes <= limit_bytes:
            try:
                held.append(torch.empty(chunk_bytes, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError:
                break
            total += chunk_bytes
    finally:
        del held
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return total


def _allreduce_worker(rank: int, world: int, backend: str, device_type: str, size_bytes: int,
                      store_path: str, result_path: str) -> None:
    import torch.distributed as dist

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        data = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
        seconds = _timed(lambda: dist.all_reduce(data), _sync(device), 5)
        if rank == 0:
            # nccl-tests' bus bandwidth: what each link carries in a ring all-reduce
            bus = size_bytes / seconds * 2 * (world - 1) / world / 1e9
            with open(result_path, "w", encoding="utf-8") as fh:
                json.dump({"world": world, "backend": backend, "size_bytes": size_bytes,
                           "seconds": seconds, "busbw_gbps": bus}, fh)
    finally:
        dist.destroy_process_group()


def measure_allreduce(world: int, *, backend: str = "nccl", device_type: str = "cuda",
                      size_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """All-reduce bus bandwidth over ``world`` processes, one device each (nccl-tests' busbw)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gpukit-allreduce-") as folder:
        store, result = os.path.join(folder, "store"), os.path.join(folder, "result.json")
        mp.start_processes(_allreduce_worker, args=(world, backend, device_type, size_bytes, store, result),
                           nprocs=world, join=True, start_method="spawn")
        with open(result, encoding="utf-8") as fh:
            return json.load(fh)


def _nvml_now(index: int) -> dict[str, Any]:
    from gpukit.devices import gpu_health

    try:
        return gpu_health(index).to_dict()
    except Exception as exc:  # noqa: BLE001 - a reading that fails must not lose the measurement
        return {"error": str(exc)}


def probe_gpu(index: int, *, copy_bytes: int, matmul_n: int, alloc_limit_bytes: int | None) -> dict[str, Any]:
    """Every per-GPU measurement of ``cuda:0`` (NVML ``index``), as one JSON-ready dict."""
    device = torch.device("cuda", 0)
    torch.cuda.init()
    props = torch.cuda.get_device_properties(device)
    bf16 = torch.cuda.is_bf16_supported()
    free_before, total = torch.cuda.mem_get_info(device)
    out: dict[str, Any] = {"index": index, "cuda_name": props.name, "capability": f"{props.major}.{props.minor}",
                           "multiprocessors": props.multi_processor_count, "free_bytes": free_before,
                           "total_bytes": total}
    out["copies"] = measure_copies(device, copy_bytes, during=lambda: _nvml_now(index))
    out["matmul"] = measure_matmul(device, torch.bfloat16 if bf16 else torch.float16, matmul_n,
                                   during=lambda: _nvml_now(index))
    # 2 GiB each way (4 GiB in all) where it fits easily: large enough to leave every cache behind
    memory_bytes = min(2 * _GIB, max(64 * 2**20, free_before // 8))
    out["device_memory"] = measure_device_memory(device, memory_bytes)
    torch.cuda.empty_cache()  # its blocks back to the driver: the allocatable memory below is measured against NVML's free
    if alloc_limit_bytes is not None:
        free_now = torch.cuda.mem_get_info(device)[0]
        out["allocatable_bytes"] = measure_allocatable(device, min(alloc_limit_bytes, free_now))
        out["free_bytes_at_allocation"] = free_now
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpukit.doctor._gpu_probe")
    sub = parser.add_subparsers(dest="what", required=True)
    gpu = sub.add_parser("gpu")
    gpu.add_argument("--index", type=int, required=True, help="NVML index of the GPU this process sees as cuda:0")
    gpu.add_argument("--copy-mib", type=int, default=256)
    gpu.add_argument("--matmul-n", type=int, default=8192)
    gpu.add_argument("--alloc-limit-mib", type=int, default=None, help="leave out: do not try to allocate")
    reduce = sub.add_parser("allreduce")
    reduce.add_argument("--world", type=int, required=True)
    reduce.add_argument("--backend", default="nccl")
    reduce.add_argument("--device-type", default="cuda")
    reduce.add_argument("--size-mib", type=int, default=256)
    args = parser.parse_args(argv)
    needs_cuda = args.what == "gpu" or args.device_type == "cuda"
    if needs_cuda and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        sys.stdout.write(json.dumps({"error": f"torch {torch.__version__} ({build}) sees no CUDA GPU here; "
                                              "install a CUDA build of torch that this driver runs"}) + "\n")
        return 3
    if args.what == "gpu":
        limit = None if args.alloc_limit_mib is None else args.alloc_limit_mib * 2**20
        result = probe_gpu(args.index, copy_bytes=args.copy_mib * 2**20, matmul_n=args.matmul_n,
                           alloc_limit_bytes=limit)
    else:
        result = measure_allreduce(args.world, backend=args.backend, device_type=args.device_type,
                                   size_bytes=args.size_mib * 2**20)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
