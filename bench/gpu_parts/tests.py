"""gpu-check part `tests`: every requires_gpu / requires_gpus test, one result line per test."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

from _common import DRY, OUT, ROOT, emit

MARKERS = "requires_gpu or requires_gpus"


def main() -> None:
    junit = OUT / "junit-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", MARKERS, "-p", "no:cacheprovider", "-v", "-rfE",
           "--timeout", "150", f"--junitxml={junit}", "--continue-on-collection-errors"]
    cmd += shlex.split(os.environ.get("GPU_CHECK_PYTEST_ARGS", ""))  # e.g. -k "not compile" on a short lease
    if DRY:  # collected, not run: no assertion to rewrite (~4 s of a 10 s collection)
        cmd += ["--collect-only", "-q", "--assert=plain"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    print(proc.stdout[-20000:], proc.stderr[-4000:], flush=True)
    if DRY:
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        count = int(found.group(1)) if found else 0
        emit("collected", "ok" if proc.returncode == 0 and count else "fail", count, "tests",
             f"pytest exit {proc.returncode}")
        return
    if not junit.exists():
        emit("pytest", "fail", detail=f"no junit report; pytest exit {proc.returncode}")
        return
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status, detail = "ok", f"{float(case.get('time', 0)):.1f} s"
        for tag, mapped in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
            node = case.find(tag)
            if node is not None:
                status, detail = mapped, (node.get("message") or "").splitlines()[0][:300] if node.get("message") else tag
        emit(name, status, detail=detail)
    emit("pytest", "ok" if proc.returncode == 0 else "fail", detail=f"exit {proc.returncode}")


if __name__ == "__main__":
    main()
