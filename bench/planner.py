"""How good is the memory planner? ``estimate_memory`` against measured CPU allocations.

For each model (an MLP, a CNN, a small transformer, a Hugging Face Llama built from a config
when ``transformers`` is installed), precision (32-true, bf16-mixed, bf16-true) and activation
checkpointing (off / every block), the plan for ``device="cpu"`` is set against two real
training steps measured by torch's profiler on the CPU allocator
(``gpukit.memory._measure_cpu.measure_step_memory``): parameters, gradients, optimizer state,
activations and the peak, as estimate/measured ratios. FSDP at 2 ranks (gloo processes,
``bench/_planner_fsdp.py``) compares ``shard_estimate``'s per-rank peak with rank 0's measured
peak. GPU rows (``torch.cuda.max_memory_allocated``) run only where a GPU is lent.

``--speed``: the planner's own cost on ``planner_models.transformer_48`` (48 identical encoder
layers, 151 M parameters, batch 8 x 256 tokens): ``gpukit plan`` and ``gpukit plan --fit``, each a
fresh process, wall and CPU time; with ``--before-src DIR`` (an older ``src/``, e.g. from ``git
archive <commit> src``) the same commands on that code, interleaved, and whether both printed the
same figures and ranking (goal: ``plan --fit`` <= 5 s, the same output).

Run: ``python bench/planner.py [--models mlp,cnn] [--no-fsdp]``,
``python bench/planner.py --speed [--before-src DIR] [--reps N] [--fit 24GiB]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gpukit.accelerators import get_accelerator
from gpukit.memory import estimate_memory, measure_peak_memory, shard_estimate
from gpukit.memory._measure_cpu import measure_step_memory
from gpukit.precision import get_precision
from gpukit.memory import unit_param_counts, units_to_shard
from gpukit.precision import fsdp_own_unit_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "memory"))
from planner_models import BATCHES, MODELS  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
FIELDS = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "peak_bytes")


def _available(names: list[str]) -> list[str]:
    out = []
    for name in names:
        try:
            MODELS[name][0]()
            out.append(name)
        except ImportError as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    return out


def _row(where: str, name: str, precision: str, ac: bool, estimate: object, measured: dict) -> dict:
    ratios = {f: (getattr(estimate, f) / measured[f] if measured.get(f) else None) for f in FIELDS}
    return {"where": where, "model": name, "precision": precision, "ac": ac,
            "peak_mib": (getattr(estimate, "peak_bytes") / 2**20, measured["peak_bytes"] / 2**20), **ratios}


def cpu_rows(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        factory, batch_of = MODELS[name]
        for precision in PRECISIONS:
            for ac in (False, True):
                torch.manual_seed(0)
                model, batch = factory(), batch_of(BATCHES[name])
                policy = True if ac else None
                estimate = estimate_memory(model, "adam", batch, precision=precision, device="cpu",
                                           activation_checkpointing=policy)
                measured = measure_step_memory(copy.deepcopy(model), batch, precision=precision,
                                               activation_checkpointing=policy)
                rows.append(_row("cpu", name, precision, ac, estimate, measured.to_dict()))
                print(_format(rows[-1]), flush=True)
    return rows


def fsdp_rows(names: list[str]) -> list[dict]:
    """2 gloo ranks: shard_estimate's per-rank peak against rank 0's measured one."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        worker = Path(__file__).with_name("_planner_fsdp.py")
        proc = subprocess.run([sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", str(worker), out, *names],
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return []
        measured = json.loads(Path(out, "fsdp-rank0.json").read_text())
    rows = []
    for m in measured:
        factory, batch_of = MODELS[m["model"]]
        torch.manual_seed(0)
        model = factory()
        policy = True if m["ac"] else None
        single = estimate_memory(model, "adam", batch_of(BATCHES[m["model"]]), precision=m["precision"],
                                 device="cpu", activation_checkpointing=policy)
        # the units FSDPStrategy makes for this precision (norm layers apart where their dtype differs)
        chosen = get_precision(m["precision"], get_accelerator("cpu"), torch.device("cpu"))
        units = units_to_shard(model, always=fsdp_own_unit_layers(chosen.name))
        per_rank = shard_estimate(single, 2, unit_param_counts(model, units))
        assert len(units) + 1 == m["units"], (m, len(units))  # the same units as the worker's Session
        rows.append(_row("fsdp x2 (rank 0)", m["model"], m["precision"], m["ac"], per_rank,
                         {"peak_bytes": m["peak_bytes"]}))
        print(_format(rows[-1]), flush=True)
    return rows


def gpu_rows(names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        factory, batch_of = MODELS[name]
        for precision in PRECISIONS:
            torch.manual_seed(0)
            model, batch = factory(), batch_of(BATCHES[name])
            estimate = estimate_memory(model, "adam", batch, precision=precision, device="cuda")
            peak = measure_peak_memory(model, batch, precision=precision)
            rows.append(_row("cuda", name, precision, False, estimate, {"peak_bytes": peak}))
            print(_format(rows[-1]), flush=True)
    return rows


def _format(row: dict) -> str:
    cells = " ".join(f"{row[f]:7.3f}" if row[f] is not None else "      -" for f in FIELDS)
    est, meas = row["peak_mib"]
    return (f"| {row['where']:<17}| {row['model']:<12}| {row['precision']:<11}| {'full' if row['ac'] else 'none':<5}| "
            + " | ".join(c for c in cells.split()) + f" | {est:7.1f} / {meas:7.1f} |")


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, stdout) of one run of ``cmd``."""
    import resource
    import time

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 2):  # 2: --fit found nothing (still a figure to compare)
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def speed(before_src: str | None, reps: int, memory: str) -> None:
    """``gpukit plan`` / ``plan --fit`` on the 48-layer transformer, this code and (optionally) older code."""
    import statistics

    here = Path(__file__).resolve().parents[1]
    codes = {"now": str(here / "src")} | ({"before": before_src} if before_src else {})
    model = "planner_models:transformer_48"
    commands = {"plan": [sys.executable, "-m", "gpukit", "plan", model],
                "plan --fit": [sys.executable, "-m", "gpukit", "plan", model, "--fit", memory],
                # one process planning, as before --jobs existed (now only: older code has no --jobs)
                "plan --fit --jobs 1": [sys.executable, "-m", "gpukit", "plan", model, "--fit", memory, "--jobs", "1"]}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    outputs: dict[tuple[str, str], str] = {}
    load = os.getloadavg()[0]
    envs = {code: {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(here / "tests" / "memory")])}
            for code, src in codes.items()}
    has_jobs = {code: "--jobs" in subprocess.run([sys.executable, "-m", "gpukit", "plan", "--help"], env=env,
                                                  capture_output=True, text=True).stdout for code, env in envs.items()}
    for _ in range(reps):
        for code, env in envs.items():
            for name, cmd in commands.items():
                if "--jobs" in cmd and not has_jobs[code]:
                    continue
                wall, cpu, out = _timed(cmd, env)
                samples.setdefault((code, name), []).append((wall, cpu))
                outputs[(code, name)] = out
    print(f"planner speed: transformer_48, {reps} run(s) each, medians; load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print("| code | command | wall | CPU |")
    print("|---|---|---:|---:|")
    for (code, name), values in samples.items():
        print(f"| {code} | {name} | {statistics.median(w for w, _ in values):.1f} s | "
              f"{statistics.median(c for _, c in values):.1f} s |")
    if before_src:
        for name in commands:
            if ("before", name) not in outputs:
                continue
            same = outputs[("now", name)] == outputs[("before", name)]
            print(f"{name}: {'the same output' if same else 'OUTPUT DIFFERS'} before and now")
            if not same:
                print("--- before\n" + outputs[("before", name)] + "--- now\n" + outputs[("now", name)])
    if outputs[("now", "plan --fit")] != outputs[("now", "plan --fit --jobs 1")]:
        print("plan --fit: OUTPUT DIFFERS with --jobs 1")
    print(outputs[("now", "plan --fit")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true", help="the planner's own cost (see above)")
    parser.add_argument("--before-src", help="with --speed: an older src/ directory to compare with")
    parser.add_argument("--reps", type=int, default=1, help="with --speed: runs per command")
    parser.add_argument("--fit", default="24GiB", help="with --speed: the memory per device for plan --fit")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (make gpu-check)")
    args = parser.parse_args()
    if args.speed:
        speed(args.before_src, args.reps, args.fit)
        return
    names = _available(args.models.split(","))
    print(f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print("| where | model | precision | ckpt | params | grads | opt state | activations | peak | peak MiB est / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [] if args.gpu_only else cpu_rows(names)
    if not (args.no_fsdp or args.gpu_only):
        rows += fsdp_rows(names)
    if torch.cuda.is_available():
        rows += gpu_rows(names)
    else:
        print("| cuda | all | all | - | to run where a GPU is lent |")
    if not rows:
        return
    worst = max(abs(1 - r["peak_bytes"]) for r in rows if r["peak_bytes"] is not None)
    print(f"worst peak error: {worst:.1%} over {len(rows)} rows (goal: within 15%)")


if __name__ == "__main__":
    main()
