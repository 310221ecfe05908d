"""`make gpu-check`: one prepared command that proves gpukit's GPU paths on a lent GPU machine.

    make gpu-check                       # everything, in order of value, within --budget-s
    python bench/gpu_check.py --only speed,memory
    python bench/gpu_check.py --dry-run  # every part on the CPU with tiny sizes (the suite runs it)

Each part (bench/gpu_parts/<part>.py) runs in its own process under its own time limit, and the
whole check stays within ``--budget-s`` (default 420 s: the lent machine gives 15 minutes, its
start takes some of them; the check gets about 7). A result with a goal says it and whether it was
met (``goal`` and ``met`` in results.jsonl, the goal column of the table; a missed goal is a
``warn``, not a failure: the figure is recorded with what explains it). Results go to ``$GPUKIT_CHECK_OUT`` (default ./gpu-check-results/) as
they come: results.jsonl (one line per result), results.md (the table, rewritten after each
part) and log.txt (every part's output), so a run cut off still returns what it measured.

Nothing is installed: gpukit runs from this checkout (PYTHONPATH=src), every package is the
machine's own, and a missing optional one is a skip with its reason. On a machine without a CUDA
GPU it lists the plan and exits 0 in seconds. Exit status: 0 when no result failed, 1 otherwise.
This script never imports torch itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS_DIR = ROOT / "bench" / "gpu_parts"


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: int
    what: str


# In order of value: the goals of issue 37 first (each row says its goal and whether it was met),
# then what has run on a GPU once, then the figures RESULTS.md lacks.
PARTS = (
    Part("env", 60, "versions: python, torch, CUDA, driver, the GPU, the packages the checks use"),
    Part("speed", 150, "P6 pinned/pageable copies vs the link, P1 per-step overhead (<= 1.01x plain), P5 the "
                       "tutorial loop vs the automatic settings (>= 3x)"),
    Part("mfu", 150, "P7 GPT-2 small: plain torch, gpukit (within 2% of plain), automatic settings (>= 40% MFU on "
                     "H100/H200), gpukit's counted FLOPs beside the formula"),
    Part("syncs", 60, "a Session epoch under torch.cuda.set_sync_debug_mode('error'): no sync in gpukit's step path"),
    Part("doctor_gpu", 90, "`gpukit doctor --gpu` against its per-model floors: copies, matmul, memory bandwidth, ECC"),
    Part("tests", 180, "every requires_gpu / requires_gpus test, and the one-GPU forms of the 2-GPU ones"),
    Part("nvml", 60, "real NVML: `gpukit ls --json` vs nvidia-smi field by field, select, a claim of the real UUID, doctor"),
    Part("demo", 90, "`gpukit demo` on the GPU: precision chosen, accuracy, throughput"),
    Part("precision", 90, "32-true / bf16-mixed / 16-mixed (GradScaler, an inf step skipped) / bf16-true loss curves"),
    Part("memory", 120, "planner vs torch.cuda.max_memory_allocated: MLP, CNN, transformer, HF Llama"),
    Part("tensor", 90, "tensor parallelism on one GPU: a tensor x2 rank's planned peak vs its shard model's "
                       "measured one; the plan applied over a 1-rank mesh (NCCL) equals the plain model"),
    Part("checkpoint", 60, "CUDA tensors: save, resume on the GPU, load where CUDA is hidden (map_location)"),
    Part("inference", 180, "issue 40: a model over a cuda:0 budget half its size, CPU + disk offload streamed: "
                           "bit-exact vs whole, predicted vs measured peak, tokens/s vs the plan's bound; "
                           "int8 weights bit-exact vs the same quantisation whole"),
    Part("suite", 300, "what time is left: the CPU suite with a GPU visible (tests whose paths change with CUDA)"),
)
_STATUS_ORDER = ("fail", "warn", "ok", "info", "skip")


def _cuda_here(python: str) -> tuple[bool, str]:
    """Whether torch sees a CUDA GPU, asked in a child process (this one never imports torch)."""
    code = "import torch; print(torch.__version__, torch.cuda.is_available())"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"could not ask torch: {exc}"
    if proc.returncode != 0:
        return False, f"torch is not importable here ({(proc.stderr.strip().splitlines() or ['?'])[-1]})"
    version, available = proc.stdout.split()
    return available == "True", f"torch {version}"


def _records(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut off when a part was killed mid-write
            continue
    return records


def write_table(out: Path) -> str:
    """results.md from results.jsonl: one row per result, the parts in order."""
    rows = ["| part | check | status | value | goal | detail |", "|---|---|---|---|---|---|"]
    for r in _records(out):
        value = "" if r.get("value") is None else f"{r['value']:.4g}{' ' + r['unit'] if r.get('unit') else ''}"
        detail = str(r.get("detail", "")).replace("|", "/").replace("\n", " ")[:240]
        goal = str(r.get("goal") or "").replace("|", "/")
        if goal and r.get("met") is not None:
            goal += ": met" if r["met"] else ": MISSED"
        rows.append(f"| {r['part']} | {r['check']} | {r['status']} | {value} | {goal} | {detail} |")
    text = "\n".join(rows) + "\n"
    (out / "results.md").write_text(text, encoding="utf-8")
    return text


def _run_part(part: Part, limit_s: float, out: Path, python: str, dry_run: bool, log) -> tuple[int | None, float]:
    env = {**os.environ, "GPUKIT_CHECK_OUT": str(out), "PYTHONUNBUFFERED": "1", "GPUKIT_CHECK_PART_LIMIT_S": f"{limit_s:.0f}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    cmd = [python, str(PARTS_DIR / f"{part.name}.py"), *(["--dry-run"] if dry_run else [])]
    log.write(f"\n===== {part.name} (limit {limit_s:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)  # its children too (pytest's, the probes')
        proc.wait()
        code = None
    return code, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 420)))
    parser.add_argument("--limit", action="append", default=[], metavar="PART=S",
                        help="another time limit for a part, e.g. --limit tests=90 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="run every part on the CPU with tiny sizes")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with torch (default: this one)")
    args = parser.parse_args(argv)
    names = {p.name for p in PARTS}
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    unknown = sorted(set(only + skip) - names)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(p.name for p in PARTS)}")
    limits = {}
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in names or not seconds.isdigit():
            parser.error(f"--limit {item!r}: use PART=SECONDS with a part of {', '.join(p.name for p in PARTS)}")
        limits[name] = int(seconds)
    plan = [Part(p.name, limits.get(p.name, p.limit_s), p.what) for p in PARTS
            if (not only or p.name in only) and p.name not in skip]
    out = Path(os.environ.get("GPUKIT_CHECK_OUT") or ROOT / "gpu-check-results")
    print(f"gpu-check: {len(plan)} part(s), budget {args.budget_s:.0f} s, results in {out}/", flush=True)
    for part in plan:
        print(f"  {part.name:<11} <= {part.limit_s:>3} s  {part.what}", flush=True)
    cuda, why = (False, "dry run") if args.dry_run else _cuda_here(args.python)  # a dry run runs either way
    if not cuda and not args.dry_run:
        print(f"no CUDA GPU: nothing to check ({why}). The plan above runs where a GPU is lent; "
              "`--dry-run` runs it on the CPU with tiny sizes.", flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    with open(out / "log.txt", "a", encoding="utf-8") as log:
        for part in plan:
            left = deadline - time.monotonic()
            if left < 15:
                _note(out, part.name, "skip", f"out of time: {left:.0f} s of the budget left")
                continue
            code, took = _run_part(part, min(part.limit_s, left), out, args.python, args.dry_run, log)
            status, said = ("ok", f"exit 0 in {took:.0f} s") if code == 0 else (
                "fail", f"killed at its {min(part.limit_s, left):.0f} s limit" if code is None else f"exit {code} in {took:.0f} s")
            _note(out, part.name, status, said, seconds=took)
            print(f"gpu-check: {part.name}: {said}", flush=True)
            write_table(out)
    table = write_table(out)
    counts = {s: sum(r["status"] == s for r in _records(out)) for s in _STATUS_ORDER}
    print(table, flush=True)
    print("gpu-check: " + ", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
    return 1 if counts["fail"] else 0


def _note(out: Path, part: str, status: str, detail: str, **extra: float) -> None:
    record = {"part": part, "check": "(part)", "status": status, "value": None, "unit": None, "detail": detail,
              "time": time.time(), **extra}
    with open(out / "results.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
