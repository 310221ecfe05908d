"""Real unprivileged users for the multi-user tests, and a way to run code as one of them.

When the suite runs as root (as CI does), :func:`unprivileged_users` creates two system accounts with
``useradd`` (kept for later runs: another test session may be using them) and returns them;
otherwise it returns the reason to skip. :func:`run_as` forks, and the child drops to the user's
uid and gid (no supplementary groups) before running a function: a real process of that account,
making real system calls with its credentials. Forking (rather than exec'ing a fresh interpreter)
keeps it working where the interpreter lives in a folder other users cannot read (root's home);
what the child imports later must then already be imported, hence :data:`PRELOAD`.
"""

from __future__ import annotations

import fcntl
import importlib
import io
import os
import pickle
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMES = ("gpukit-alice", "gpukit-bob")

PRELOAD = (
    "gpukit.devices._claims", "gpukit.devices._queue", "gpukit.devices._claims_admin", "gpukit.devices._claims_clean",
    "gpukit.devices._fake",
    "gpukit.cli._main", "gpukit.cli.ls", "gpukit.cli.select", "gpukit.cli.doctor", "gpukit.cli.claims",
    "gpukit.cli._gpu_table", "gpukit.doctor", "gpukit.doctor._claims", "rich.console", "rich.table", "rich.text",
    "rich.live", "rich.box", "rich.status", "rich.markup", "rich.segment", "rich.cells", "rich._loop",
    "psutil", "pwd", "fcntl", "secrets", "socket", "json", "pickle", "traceback", "shutil", "getpass",
    "encodings.idna", "click.exceptions", "difflib", "gettext", "textwrap", "shlex", "unicodedata",
)


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def _user(useradd: str, name: str) -> User | str:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        done = subprocess.run([useradd, "--system", "--no-create-home", "--user-group",
                               "--shell", "/usr/sbin/nologin", name], capture_output=True, text=True)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            return f"useradd {name} failed: {done.stderr.strip() or done.returncode}"
    return User(name, entry.pw_uid, entry.pw_gid)


def unprivileged_users() -> list[User] | str:
    """Two unprivileged users (made with ``useradd`` if missing), or why they cannot be had."""
    if os.geteuid() != 0:
        return ("the multi-user tests create two unprivileged users with useradd, which needs root; "
                "run the suite as root (as CI does)")
    useradd = shutil.which("useradd") or ("/usr/sbin/useradd" if os.path.exists("/usr/sbin/useradd") else None)
    if useradd is None:
        return "no useradd on this machine (Debian: apt-get install passwd)"
    blocked = environment_blocked()
    if blocked is not None:
        return blocked
    users = []
    with open(os.path.join(tempfile.gettempdir(), "gpukit-tests-useradd.lock"), "a") as lock:
        # test processes side by side (pytest -n) would each run useradd: one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in NAMES:
            found = _user(useradd, name)
            if isinstance(found, str):
                return found
            users.append(found)
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    return users


ENVIRONMENT = ("gpukit", "rich", "click", "psutil")  # what the test users' processes import from disk


def unreadable_for_others(path: Path) -> str | None:
    """Why another (unprivileged, unrelated) user cannot read ``path``: the first folder on the way
    they may not enter, or the path itself not readable; ``None`` when they can."""
    path = Path(os.path.realpath(path))
    for folder in [*reversed(path.parents), path]:
        try:
            mode = os.stat(folder).st_mode
        except OSError as exc:
            return f"{folder} cannot be looked at ({exc.strerror})"
        if folder != path and not mode & stat.S_IXOTH:
            return f"{folder} (mode {stat.S_IMODE(mode):04o}) does not let other users enter it"
    if not os.stat(path).st_mode & stat.S_IROTH:
        return f"{path} (mode {stat.S_IMODE(os.stat(path).st_mode):04o}) is not readable by other users"
    return None


def environment_blocked() -> str | None:
    """Why the test users could not import this environment (the clone or the virtual environment
    lies in a folder other users cannot enter, e.g. under root's 0700 home or a ``mktemp -d``),
    else ``None``. Their processes are forked and import what is not loaded yet from disk as
    themselves: a lazy import would fail half-way (``No module named 'rich._emoji_codes'``) and
    read as a gpukit traceback, so the multi-user tests skip instead, saying how to run them."""
    for name in ENVIRONMENT:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        where = Path(module.__file__ or "").parent
        why = unreadable_for_others(where)
        if why is not None:
            return (f"the multi-user tests run as other users, who could not import {name} from {where}: {why}. "
                    "Put the clone and its environment where other users can read them (e.g. under /srv or /opt), "
                    "or let them in (chmod o+x on that folder)")
    return None


@dataclass
class Outcome:
    """What a function run as another user did: ``kind`` is ``"ok"`` (returned ``value``), ``"exit"``
    (SystemExit with ``value``), ``"raise"`` (``error_type``: ``message``), or ``"hang"``."""

    kind: str
    value: Any = None
    error_type: str | None = None
    message: str = ""
    stdout: str = ""
    stderr: str = ""
    trace: str = ""

    def describe(self) -> str:
        return (f"{self.kind} value={self.value!r} error={self.error_type}: {self.message}\n"
                f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}\n{self.trace[-3000:]}")


def _child(user: User, fn: Callable[..., Any], args: tuple[Any, ...], out: int, err: int, result_fd: int,
           env: dict[str, str]) -> None:
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # pytest-timeout's alarm is the parent's business
        os.setgroups([])
        os.setgid(user.gid)
        os.setuid(user.uid)
        for key in ("XDG_RUNTIME_DIR",):
            os.environ.pop(key, None)
        os.environ.update({"USER": user.name, "LOGNAME": user.name, "HOME": env.pop("HOME", "/nonexistent")})
        os.environ.update(env)
        tempfile.tempdir = None  # TMPDIR may be new here
        from gpukit.devices import _nvml

        _nvml.shutdown()  # GPUKIT_FAKE_GPUS may be new here
        result: tuple[Any, ...] = ("ok", fn(*args))
    except SystemExit as exc:
        result = ("exit", exc.code)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = ("raise", type(exc).__name__, str(exc), traceback.format_exc())
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001
        data = pickle.dumps(("raise", "PicklingError", repr(result)[:2000], ""))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        view = memoryview(data)
        while view:
            view = view[os.write(result_fd, view):]
    finally:
        os._exit(0)


def start_as(user: User, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> Running:
    """Fork a process of ``user`` that runs ``fn(*args)``; :meth:`Running.wait` for its outcome."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(user, fn, args, out.fileno(), err.fileno(), write_end, dict(env or {}))
    os.close(write_end)
    return Running(pid, read_end, out, err)


@dataclass
class Running:
    pid: int
    fd: int
    out: Any
    err: Any

    def wait(self, timeout_s: float = 60.0) -> Outcome:
        data = b""
        deadline = time.monotonic() + timeout_s
        hung = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                break
            data += chunk
        if hung:
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        streams = []
        for handle in (self.out, self.err):
            handle.seek(0)
            streams.append(handle.read().decode(errors="replace"))
            handle.close()
        if hung:
            return Outcome("hang", stdout=streams[0], stderr=streams[1])
        if not data:
            return Outcome("raise", error_type="died", message="the child ended without a result",
                           stdout=streams[0], stderr=streams[1])
        result = pickle.loads(data)
        if result[0] == "raise":
            return Outcome("raise", error_type=result[1], message=result[2], trace=result[3],
                           stdout=streams[0], stderr=streams[1])
        return Outcome(result[0], result[1], stdout=streams[0], stderr=streams[1])

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_as(user: User, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
           env: dict[str, str] | None = None) -> Outcome:
    """Run ``fn(*args)`` as ``user`` in a forked process and return what happened."""
    return start_as(user, fn, *args, env=env).wait(timeout_s)


def cli(*argv: str) -> int:
    """``gpukit ARGV`` in this process (for :func:`run_as`): its exit status."""
    from gpukit.cli._main import main

    try:
        main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    return 0


def shared_area() -> Path:
    """A fresh root-owned folder every user can read (0755), under the temp dir; the caller removes it."""
    base = Path(tempfile.mkdtemp(prefix="gpukit-multiuser-"))
    os.chmod(base, 0o755)
    return base


def sticky_folder(path: Path) -> Path:
    """``path`` made like /tmp: root-owned, mode 1777."""
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o1777)
    return path


class Holder:
    """A process of ``user`` that claims GPUs and holds them until :meth:`release` (or :meth:`kill`).

    With ``gate=True`` it waits for :meth:`go` before claiming (so a test can act on its pid first).
    """

    def __init__(self, user: User, claim: dict[str, Any], env: dict[str, str] | None = None,
                 gate: bool = False) -> None:
        self._ready_r, ready_w = os.pipe()
        release_r, self._release_w = os.pipe()
        go_r, self._go_w = os.pipe() if gate else (None, None)
        self.running = start_as(user, _hold, claim, ready_w, release_r, go_r, env=env)
        for fd in (ready_w, release_r, go_r):
            if fd is not None:
                os.close(fd)
        self.pid = self.running.pid
        self.uuids: list[str] | None = None
        self.error: str | None = None

    def go(self) -> None:
        if self._go_w is not None:
            os.write(self._go_w, b"g")

    def wait_claimed(self, timeout_s: float = 60.0) -> list[str] | None:
        """The claimed UUIDs, or ``None`` when the claim failed (``error`` says why)."""
        ready, _, _ = select.select([self._ready_r], [], [], timeout_s)
        line = os.read(self._ready_r, 1 << 16).decode() if ready else ""
        if line.startswith("ok "):
            self.uuids = line[3:].split()
        else:
            self.error = line or "no answer"
        return self.uuids

    def release(self, timeout_s: float = 60.0) -> Outcome:
        try:
            os.write(self._release_w, b"r")
        except OSError:
            pass
        return self._end(timeout_s)

    def kill(self) -> Outcome:
        self.running.kill()
        return self._end(10.0)

    def _end(self, timeout_s: float) -> Outcome:
        outcome = self.running.wait(timeout_s)
        for fd in (self._ready_r, self._release_w, self._go_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        return outcome


def _hold(claim: dict[str, Any], ready_w: int, release_r: int, go_r: int | None) -> list[str]:
    from gpukit.devices import claim_gpus

    if go_r is not None:
        os.read(go_r, 1)
    try:
        held = claim_gpus(**claim)
    except Exception as exc:  # noqa: BLE001 - told to the parent
        os.write(ready_w, f"error {type(exc).__name__}: {exc}".encode()[:60000])
        raise
    uuids = [g.uuid or "" for g in held.gpus]
    os.write(ready_w, ("ok " + " ".join(uuids)).encode())
    os.read(release_r, 1)
    held.release()
    return uuids
