"""Benchmark: save and restore of a model + Adam state, gpukit vs plain torch, Fabric and Accelerate.

    python bench/checkpoint.py [--size-mib 504] [--reps 5] [--dir DIR] [--tools torch,gpukit,...]

Every restore runs in a fresh process, as a resumed job does: the process builds the model
and optimizer, restores the checkpoint saved by the previous repetition (timed: the restore
call only), then saves a new one (timed) and exits. Tools take turns within each repetition
(the order rotates), medians are reported, and each row is a ratio against the others measured
in the same run. Peak memory is the process's peak RSS during the restore over its RSS just
before it (``/proc/self/clear_refs`` resets the peak), so "restore held the weights twice"
shows as a larger figure. The weights restored are checked against the ones saved.

Peers (when installed: ``pip install 'gpukit[bench]'``): Lightning Fabric's ``fabric.save`` /
``fabric.load`` and Accelerate's ``save_state`` / ``load_state`` (safetensors for the model).

``gpukit-bg`` is ``CheckpointManager.save(..., background=True)``: its process saves twice --
the first save allocates the host buffers, the second (the steady state of a training run)
reuses them -- and reports for each how long the call blocked, the total until the checkpoint
was complete on disk (``wait_for_saves`` right after the call, nothing else running), the host
memory the buffers hold, and what the save cost a training loop on this machine: the time of
``--loop-steps`` training steps run while the save writes, over the same steps with no save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = ("torch", "torch-mmap", "gpukit", "gpukit-bg", "fabric", "accelerate")
LOOP_STEPS = 3


def _model(size_mib: int):  # noqa: ANN202
    import torch

    torch.manual_seed(0)
    layers = max(1, round(size_mib / 3 / 16))  # 16 MiB of weights per layer; Adam adds 2x
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters())
    return model, optimizer


def _step(model, optimizer) -> None:  # noqa: ANN001
    import torch

    model(torch.randn(4, 2048)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _checksum(model) -> float:  # noqa: ANN001
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _setup(tool: str, model, optimizer, where: Path):  # noqa: ANN001, ANN202
    """(save(), restore()) of ``tool`` for this model and optimizer, writing under ``where``."""
    import torch

    if tool in ("torch", "torch-mmap"):
        path = where / "state.pt"
        mmap = tool == "torch-mmap"

        def save() -> None:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)

        def restore() -> None:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        return save, restore
    if tool in ("gpukit", "gpukit-bg"):
        from gpukit import CheckpointManager

        manager = CheckpointManager(where / "ckpt", keep_last=1)
        counter = [0]

        def save() -> None:
            counter[0] += 1
            manager.save(counter[0], model=model, optimizer=optimizer, background=tool == "gpukit-bg")

        def restore() -> None:
            manager.resume(model=model, optimizer=optimizer, restore_rng=False)

        return save, restore
    if tool == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1)
        model, optimizer = fabric.setup(model, optimizer)
        path = where / "fabric.ckpt"
        return (lambda: fabric.save(path, {"model": model, "optimizer": optimizer}),
                lambda: fabric.load(path, {"model": model, "optimizer": optimizer}))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    path = where / "accelerate"
    return lambda: accelerator.save_state(str(path)), lambda: accelerator.load_state(str(path))


def child(tool: str, where: Path, size_mib: int, restore_first: bool) -> None:
    """One repetition of ``tool`` in this (fresh) process; prints a JSON line."""
    model, optimizer = _model(size_mib)
    _step(model, optimizer)  # the optimizer state exists, as after training
    save, restore = _setup(tool, model, optimizer, where)
    out: dict[str, float | None] = {}
    if restore_first:
        with __import__("torch").no_grad():
            for p in model.parameters():
                p.zero_()  # so a restore that did nothing cannot pass the check
        rss_before = _rss_bytes("VmRSS")
        peak_ok = _reset_peak()
        start = time.perf_counter()
        restore()
        out["restore_s"] = time.perf_counter() - start
        out["restore_peak_extra_bytes"] = (_rss_bytes("VmHWM") - rss_before) if peak_ok else None
        out["checksum"] = _checksum(model)
    if tool == "gpukit-bg":
        out.update(_background_saves(save, model, optimizer))
    elif tool != "torch-mmap":
        os.sync()
        start, cpu = time.perf_counter(), time.process_time()
        save()
        out["save_s"] = time.perf_counter() - start
        out["save_cpu_s"] = time.process_time() - cpu  # every thread of the process
        out["saved_checksum"] = _checksum(model)
    print(json.dumps(out))


def _background_saves(save, model, optimizer) -> dict[str, float]:  # noqa: ANN001
    """Two background saves (cold, then reused host buffers) and the loop's cost of the second."""
    from gpukit.checkpoint import last_save_timings, wait_for_saves
    from gpukit.checkpoint._background import background_saves

    out: dict[str, float] = {}
    for label in ("first", "save"):
        os.sync()
        start, cpu = time.perf_counter(), time.process_time()
        save()
        blocked, blocked_cpu = time.perf_counter() - start, time.process_time() - cpu
        wait_for_saves()
        out[f"{label}_blocked_s"], out[f"{label}_s"] = blocked, time.perf_counter() - start
        out[f"{label}_blocked_cpu_s"], out[f"{label}_cpu_s"] = blocked_cpu, time.process_time() - cpu
    out["saved_checksum"] = _checksum(model)
    out["host_bytes"] = background_saves().buffers.nbytes
    timings = last_save_timings()
    out["snapshot_s"] = timings.snapshot_s if timings else None
    # what a save costs a loop that keeps training: LOOP_STEPS steps with and without one writing
    # (at lr 0: the same work, and the weights stay those every repetition restores and checks)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    start = time.perf_counter()
    for _ in range(LOOP_STEPS):
        _step(model, optimizer)
    out["loop_alone_s"] = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    save()
    for _ in range(LOOP_STEPS):
        _step(model, optimizer)
    out["loop_saving_s"] = time.perf_counter() - start
    wait_for_saves()
    out["loop_after_s"] = time.perf_counter() - start
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    return out


def _available(tool: str) -> bool:
    module = {"fabric": "lightning.fabric", "accelerate": "accelerate"}.get(tool)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None


def _run_child(tool: str, where: Path, size_mib: int, restore_first: bool) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", tool, "--dir", str(where), "--size-mib", str(size_mib)]
    if restore_first:
        cmd.append("--restore")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=504)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {', '.join(TOOLS)}")
    parser.add_argument("--child", choices=TOOLS, help=argparse.SUPPRESS)
    parser.add_argument("--restore", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Path(args.dir), args.size_mib, args.restore)
        return
    wanted = [t for t in args.tools.split(",") if t in TOOLS]
    tools = [t for t in wanted if _available(t)]
    missing = [t for t in wanted if t not in tools]
    results: dict[str, list[dict[str, float]]] = {t: [] for t in tools}
    load_before = _load_average()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        dirs = {t: Path(tmp) / t for t in tools}
        for tool in tools:  # the first checkpoint of each tool (untimed)
            dirs[tool].mkdir()
            if tool == "torch-mmap":
                continue
            expected = _run_child(tool, dirs[tool], args.size_mib, restore_first=False)["saved_checksum"]
        shutil.rmtree(dirs.get("torch-mmap", Path(tmp) / "none"), ignore_errors=True)
        for rep in range(args.reps):
            order = tools[rep % len(tools):] + tools[: rep % len(tools)]
            for tool in order:
                if tool == "torch-mmap":  # reads the plain torch file
                    shutil.copytree(dirs["torch"], dirs["torch-mmap"], dirs_exist_ok=True)
                result = _run_child(tool, dirs[tool], args.size_mib, restore_first=True)
                if abs(result["checksum"] - expected) > 1e-6 * max(1.0, abs(expected)):
                    raise SystemExit(f"{tool}: restored weights differ from the saved ones")
                results[tool].append(result)
                print(f"  rep {rep} {tool}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                                                       if k.endswith("_s")), file=sys.stderr, flush=True)
    med = {t: {k: statistics.median(r[k] for r in results[t]) for k in results[t][0]
               if results[t][0][k] is not None} for t in tools}
    mib = lambda b: f"{b / 2**20:6.0f} MiB"  # noqa: E731
    print(f"model + Adam state of ~{args.size_mib} MiB, {args.reps} repetitions (tools interleaved, fresh "
          f"process per restore), medians; load average {load_before} -> {_load_average()}"
          + (f"; not installed: {', '.join(missing)}" if missing else ""))
    print(f"{'tool':<11} {'restore':>9} {'peak extra':>11} {'save':>9}   ratios: restore / accelerate, "
          "save / torch.save")
    for tool in tools:
        row = med[tool]
        restore_ratio = (f"{row['restore_s'] / med['accelerate']['restore_s']:.2f}"
                         if "accelerate" in med else "n/a")
        save_ratio = (f"{row['save_s'] / med['torch']['save_s']:.2f}" if "save_s" in row else "-")
        peak = mib(row["restore_peak_extra_bytes"]) if "restore_peak_extra_bytes" in row else "n/a"
        save = f"{row['save_s']:8.3f}s" if "save_s" in row else "        -"
        print(f"{tool:<11} {row['restore_s']:8.3f}s {peak:>11} {save}   {restore_ratio:>6} {save_ratio:>6}")
    print("restore samples: " + "; ".join(
        f"{t} " + " ".join(f"{r['restore_s']:.2f}" for r in results[t]) for t in tools))
    print("save samples: " + "; ".join(
        f"{t} " + " ".join(f"{r['save_s']:.2f}" for r in results[t]) for t in tools if "save_s" in results[t][0]))
    if "gpukit-bg" in med and "torch" in med:
        _print_background(med["gpukit-bg"], results["gpukit-bg"], med["torch"])


def _print_background(row: dict[str, float], samples: list[dict[str, float]], torch_row: dict[str, float]) -> None:
    """The background save's figures against torch.save measured in the same run."""
    wall, cpu = torch_row["save_s"], torch_row["save_cpu_s"]
    print(f"background save (gpukit-bg), medians; ratios to torch.save ({wall:.3f} s wall, {cpu:.3f} s CPU):")
    for label, what in (("save", "steady state (host buffers reused)"), ("first", "first save of a process")):
        print(f"  {what}: blocked {row[f'{label}_blocked_s']:.3f} s ({row[f'{label}_blocked_s'] / wall:.2f}x; CPU "
              f"{row[f'{label}_blocked_cpu_s'] / cpu:.2f}x), complete on disk {row[f'{label}_s']:.3f} s "
              f"({row[f'{label}_s'] / wall:.2f}x; CPU {row[f'{label}_cpu_s'] / cpu:.2f}x)")
    print(f"  copy to host {row['snapshot_s']:.3f} s; host buffers {row['host_bytes'] / 2**20:.0f} MiB held between "
          "saves (one copy of the state)")
    print(f"  loop of {LOOP_STEPS} steps: alone {row['loop_alone_s']:.3f} s; with a background save started before "
          f"it {row['loop_saving_s']:.3f} s (+{row['loop_saving_s'] - row['loop_alone_s']:.3f} s, blocked call "
          f"included), save complete {row['loop_after_s']:.3f} s after the call")
    print("  blocked samples: " + " ".join(f"{r['save_blocked_s']:.3f}" for r in samples)
          + "; complete samples: " + " ".join(f"{r['save_s']:.3f}" for r in samples))

if __name__ == "__main__":
    main()
