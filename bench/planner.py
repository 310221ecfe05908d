"""How good is the memory planner? ``estimate_memory`` against measured CPU allocations.

For each model (an MLP, a CNN, a small transformer, a Hugging Face Llama built from a config
when ``transformers`` is installed), precision (32-true, bf16-mixed, bf16-true) and activation
checkpointing (off / every block), the plan for ``device="cpu"`` is set against two real
training steps measured by torch's profiler on the CPU allocator
(``gpukit.memory._measure_cpu.measure_step_memory``): parameters, gradients, optimizer state,
activations and the peak, as estimate/measured ratios. FSDP at 2 ranks (gloo processes,
``bench/_planner_fsdp.py``) compares ``shard_estimate``'s per-rank peak with rank 0's measured
peak. GPU rows (``torch.cuda.max_memory_allocated``) run only where a GPU is lent.

Run: ``python bench/planner.py [--models mlp,cnn] [--no-fsdp]``.
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
from gpukit.strategies._wrap import unit_param_counts, units_to_shard
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (make gpu-check)")
    args = parser.parse_args()
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
