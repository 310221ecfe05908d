"""A process that has imported torch and gpukit once and forks one child per probe.

A probe's reader in a fresh interpreter pays 2-4 s of imports (torch, mostly) for a few
milliseconds of reading; forked from this process it starts with those imports done and
nothing else: no reader has run here, no state is shared between probes (each child is its
own process, exits with ``os._exit`` and is reaped here), and what reaches the child's stdout
and stderr is what a fresh ``python -m gpukit ARGV`` / ``python -c CODE`` would print -- an
uncaught exception prints Python's own traceback and exits 1, ``sys.exit(n)`` exits ``n``,
exit handlers run. Only probes that keep the test's environment and working directory come
here (``_probe.execute(run, forked=True)``): a variable read at import would be read too early.

Protocol: one JSON request per line on stdin, ``{"argv"|"code", "out", "err", "timeout_s"}``;
one JSON reply per request on stdout, ``{"returncode": int | null}`` (null: killed after
``timeout_s``, with its process group). The first line written is ``{"ready": true}``.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import traceback

import torch  # noqa: F401  -- the imports every reader pays for, done once
import gpukit  # noqa: F401
import gpukit.checkpoint  # noqa: F401
import gpukit.cli  # noqa: F401


def _child(request: dict[str, object]) -> None:
    os.setsid()  # its own process group: a hang is killed with everything it started
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, key in ((1, "out"), (2, "err")):
        target = os.open(str(request[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    code = 0
    try:
        if "argv" in request:
            sys.argv = ["gpukit", *request["argv"]]  # type: ignore[misc]
            runpy.run_module("gpukit", run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c"]
            exec(compile(str(request["code"]), "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- what the interpreter would do with it
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout_s: float) -> int | None:
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if not ready:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"returncode": _wait(pid, float(request["timeout_s"]))}), flush=True)


if __name__ == "__main__":
    main()
