"""What every part of `make gpu-check` shares: where results go, how a record is written, the device.

Each part is a script run by bench/gpu_check.py in its own process (a crash or a hang ends that
part, not the check). It appends one JSON line per result to ``$GPUKIT_CHECK_OUT/results.jsonl``
as soon as it has it (flushed and fsynced: a run cut off still returns what it measured), and
prints its progress, which the driver keeps in log.txt. ``--dry-run`` runs the same code on the
CPU with tiny sizes: the suite does so, so that a typo cannot waste the one lent GPU run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
for path in (str(BENCH), str(ROOT / "src")):
    if path not in sys.path:
        sys.path.insert(0, path)

OUT = Path(os.environ.get("GPUKIT_CHECK_OUT") or ROOT / "gpu-check-results")
DRY = "--dry-run" in sys.argv[1:]
PART = Path(sys.argv[0]).stem
STATUSES = ("ok", "warn", "fail", "skip", "info")


def emit(check: str, status: str, value: float | None = None, unit: str | None = None, detail: str = "",
         **extra: Any) -> dict[str, Any]:
    """Write one result line and print it. ``status``: ok / warn / fail / skip / info."""
    if status not in STATUSES:
        raise ValueError(f"emit({check!r}): status {status!r} is not one of {STATUSES}")
    record = {"part": PART, "check": check, "status": status, "value": value, "unit": unit, "detail": detail,
              "dry_run": DRY, "time": time.time(), **extra}
    OUT.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str)
    with open(OUT / "results.jsonl", "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    shown = "" if value is None else f" {value:.4g}{' ' + unit if unit else ''}"
    print(f"[{PART}] {status.upper():<4} {check}:{shown} {detail}".rstrip(), flush=True)
    return record


def judged(check: str, value: float | None, unit: str | None, goal: str, met: bool | None, detail: str = "",
           **extra: Any) -> dict[str, Any]:
    """A result with a goal (``"<= 1.01x plain"``): ``ok`` when met, ``warn`` when missed (a figure that
    misses its goal is recorded with what explains it, not hidden); ``info`` in a dry run, whose tiny
    CPU sizes say nothing about the goal, and when ``met`` is ``None`` (not judgeable here)."""
    status = "info" if DRY or met is None else ("ok" if met else "warn")
    return emit(check, status, value, unit, detail, goal=goal, met=None if DRY else met, **extra)


def device() -> Any:
    """``cuda:0`` on the GPU machine, the CPU in a dry run."""
    import torch

    return torch.device("cpu") if DRY else torch.device("cuda", 0)


def sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


def gpukit_cli(*args: str, timeout_s: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gpukit ARGS`` with this checkout's sources; its output goes to the log too."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), full_env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "gpukit", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=full_env, cwd=ROOT)
    print(f"$ gpukit {' '.join(args)}  (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}", flush=True)
    return proc


def guarded(check: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one check; an exception becomes a ``fail`` record (with its last line) instead of ending the part."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every failure is a result here
        import traceback

        traceback.print_exc()
        emit(check, "fail", detail=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        return None
