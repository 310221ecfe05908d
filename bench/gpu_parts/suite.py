"""gpu-check part `suite`: the CPU test suite on a machine where CUDA is available.

Tests that pass on the CPU-only CI may take other paths when CUDA is present (a default device
of "cuda", nccl instead of gloo, pinned memory). With the time left, the suite runs in parallel
(pytest-xdist where installed) and each test's result is recorded as it ends (-v), failures as
`fail` results with their names, so a run cut off still says which tests failed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

from _common import DRY, ROOT, emit

LINE = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(tests/\S+)|(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)")


def main() -> None:
    if DRY:
        emit("suite", "skip", detail="dry run: the suite is what runs this")
        return
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", "-v", "-rfE", "--timeout", "120",
           "-m", "not requires_gpu and not requires_gpus", "--continue-on-collection-errors"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(max(2, (os.cpu_count() or 4) - 4))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    counts = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        found = LINE.search(line)
        if not found:
            continue
        outcome, name = (found.group(1), found.group(2)) if found.group(1) else (found.group(4), found.group(3))
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("FAILED", "ERROR"):
            emit(name, "fail", detail=f"{outcome} with CUDA available")
    code = proc.wait()
    emit("suite with a GPU visible", "ok" if code == 0 else "fail", counts["PASSED"], "passed",
         f"exit {code}; {counts['FAILED']} failed, {counts['ERROR']} errors, {counts['SKIPPED']} skipped")


if __name__ == "__main__":
    main()
