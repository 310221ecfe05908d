"""Hostile-input probes: plant one bad input, run one gpukit reader on it in a fresh process,
and say what happened.

Each ``corpus_<area>.py`` module here defines ``PROBES: dict[str, Callable[[Path], Run]]``: a
probe's name -> a builder that writes its hostile input under the given (empty) directory and
returns how to run the reader on it. ``test_hostile_<area>.py`` parametrises over ``PROBES``
and asserts the outcome is one of ``SAFE``; ``bench/hostile.py`` runs every corpus and prints
the table of outcomes per reader for bench/RESULTS.md. Inputs are generated at test time: no
hostile file is committed.

Outcomes (checked in this order):
- "code executed": the canary file a planted pickle would create exists afterwards;
- "hang": the process did not finish within ``timeout_s`` (it is killed);
- "traceback": a Python traceback reached the user (stderr has "Traceback (most recent");
- "clean error": the CLI exited 2 with one ``gpukit: error:`` line, or the library call raised a
  ``GpukitError`` (the snippet runner prints ``GPUKIT_ERROR <Type>: <message>`` and exits 3);
- "correct": exit 0 and the probe's own ``check`` (if any) accepted the output;
- "wrong": anything else (unexpected exit code, a check that failed).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SAFE = ("clean error", "correct")
OUTCOMES = ("clean error", "correct", "wrong", "traceback", "hang", "code executed")

_SNIPPET_RUNNER = """
import sys
from gpukit.errors import GpukitError
try:
{body}
except GpukitError as exc:
    print(f"GPUKIT_ERROR {{type(exc).__name__}}: {{exc}}", file=sys.stderr)
    sys.exit(3)
"""


@dataclass
class Run:
    """How to run one reader on a planted input.

    Exactly one of ``argv`` (gpukit CLI arguments, run as ``python -m gpukit ARGV``) and
    ``code`` (a Python snippet using the library; a ``GpukitError`` counts as a clean error).
    """

    reader: str  # the table's row: "ckpt inspect", "gpukit.load", "report", "doctor", ...
    argv: list[str] | None = None
    code: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to a copy of os.environ
    cwd: Path | None = None
    timeout_s: float = 60.0
    canary: Path | None = None  # a planted pickle's __reduce__ would create this file
    check: Callable[[subprocess.CompletedProcess[str]], None] | None = None  # for exit 0


@dataclass
class Result:
    outcome: str
    returncode: int | None
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"{self.outcome} (exit {self.returncode})\nstdout:\n{self.stdout[-2000:]}\nstderr:\n{self.stderr[-4000:]}"


def canary_pickle_payload(canary: Path) -> bytes:
    """Pickle bytes whose loading (with plain ``pickle``) creates ``canary``."""
    import pickle

    class _Plant:
        def __reduce__(self):  # noqa: D401 - the attack
            return (os.system, (f"touch {canary}",))

    return pickle.dumps(_Plant())


def execute(run: Run, *, forked: bool = False) -> Result:
    """Run the reader in a fresh process and classify the outcome (see the module docstring).

    ``forked``: the process is forked from one that has imported torch and gpukit already
    (``_zygote.py``: 2-4 s less per probe), where the run keeps the test's environment and
    working directory; otherwise a new interpreter.
    """
    if forked and not run.env and run.cwd is None:
        return _zygote().execute(run)
    env = dict(os.environ)
    env.update(run.env)
    cmd = [sys.executable, "-m", "gpukit", *run.argv] if run.argv is not None else [sys.executable, "-c", _snippet(run)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=run.cwd, capture_output=True, text=True,
                              timeout=run.timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return _timed_out(run, out, err)
    return Result(_classify(run, proc), proc.returncode, proc.stdout, proc.stderr)


def _timed_out(run: Run, out: str, err: str) -> Result:
    """A reader killed at ``run.timeout_s``: a hang, unless its pickle ran code first."""
    return Result("code executed" if run.canary is not None and run.canary.exists() else "hang", None, out, err)


def _snippet(run: Run) -> str:
    assert run.code is not None
    return _SNIPPET_RUNNER.format(body=textwrap.indent(textwrap.dedent(run.code), "    "))


class _Zygote:
    """The test process's end of ``_zygote.py``: one request, one forked child, at a time."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="gpukit-probe-"))
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_zygote.py"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError(f"the probe zygote did not start (exit {self.proc.wait()})")
        atexit.register(self.close)

    def execute(self, run: Run) -> Result:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        out, err = self.workdir / "stdout", self.workdir / "stderr"
        request = {"argv": run.argv} if run.argv is not None else {"code": _snippet(run)}
        request.update(out=str(out), err=str(err), timeout_s=run.timeout_s)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the probe zygote died (exit {self.proc.wait()})")
        returncode = json.loads(line)["returncode"]
        proc = subprocess.CompletedProcess(["<forked>"], returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
        if returncode is None:
            return _timed_out(run, proc.stdout, proc.stderr)
        return Result(_classify(run, proc), returncode, proc.stdout, proc.stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


_zygotes: list[_Zygote] = []


def _zygote() -> _Zygote:
    if not _zygotes or _zygotes[0].proc.poll() is not None:
        _zygotes[:] = [_Zygote()]
    return _zygotes[0]


def _classify(run: Run, proc: subprocess.CompletedProcess[str]) -> str:
    if run.canary is not None and run.canary.exists():
        return "code executed"
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback"
    if run.argv is not None and proc.returncode == 2:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return "clean error" if lines and lines[0].startswith("gpukit: error:") else "wrong"
    if run.code is not None and proc.returncode == 3 and "GPUKIT_ERROR " in proc.stderr:
        return "clean error"
    if proc.returncode == 0:
        if run.check is not None:
            try:
                run.check(proc)
            except AssertionError:
                return "wrong"
        return "correct"
    return "wrong"
