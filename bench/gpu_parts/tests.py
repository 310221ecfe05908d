"""gpu-check part `tests`: every requires_gpu / requires_gpus test, one result line per test.

Each test's result is written as pytest reports it (``-v``), not after the run: the part's time limit
is shorter than the tests together may take (multi-process and compile tests among them), and a run
cut off must still say which tests passed and failed. The failures' messages follow from the junit
report when pytest ends.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET

from _common import DRY, OUT, ROOT, emit

MARKERS = "requires_gpu or requires_gpus"
#: ``tests/x.py::test_y[id] PASSED   [ 10%]``: one test's outcome (setup and teardown errors too)
RESULT = re.compile(r"^(\S*::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
STATUS = {"PASSED": "ok", "XFAIL": "ok", "XPASS": "ok", "SKIPPED": "skip", "FAILED": "fail", "ERROR": "fail"}


def main() -> None:
    junit = OUT / "junit-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", MARKERS, "-p", "no:cacheprovider", "-v", "-rfE",
           "--timeout", "150", f"--junitxml={junit}", "--continue-on-collection-errors"]
    cmd += shlex.split(os.environ.get("GPU_CHECK_PYTEST_ARGS", ""))  # e.g. -k "not compile" on a short lease
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    if DRY:  # collected, not run: no assertion to rewrite (~4 s of a 10 s collection)
        cmd += ["--collect-only", "-q", "--assert=plain"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        print(proc.stdout[-20000:], proc.stderr[-4000:], flush=True)
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        count = int(found.group(1)) if found else 0
        emit("collected", "ok" if proc.returncode == 0 and count else "fail", count, "tests",
             f"pytest exit {proc.returncode}")
        return
    counts = dict.fromkeys(STATUS, 0)
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # each result as it comes: a part killed at its limit keeps them
            print(line, end="", flush=True)
            found = RESULT.match(line)
            if found:
                name, outcome = found.group(1), found.group(2)
                counts[outcome] += 1
                emit(name, STATUS[outcome], detail=outcome if outcome != "ERROR" else "ERROR (setup or teardown)")
        code = proc.wait()
    if junit.exists():  # why the failures failed (pytest writes the report at its end)
        for case in ET.parse(junit).getroot().iter("testcase"):
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                    emit(f"{name}: why", "info", detail=(node.get("message") or tag).splitlines()[0][:300])
    emit("pytest", "ok" if code == 0 else "fail", counts["PASSED"], "passed",
         f"exit {code}; " + ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n and k != "PASSED"))


if __name__ == "__main__":
    main()
