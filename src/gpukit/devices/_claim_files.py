"""The claim directory: lock and owner files per GPU, and who holds which GPU.

The files behind :mod:`gpukit.devices._claims` (which takes claims) and what
:mod:`gpukit.devices._select` reads to skip claimed GPUs. A claim is an OS file lock (``filelock``: ``flock`` on Unix) on ``<claim dir>/<GPU UUID>.lock``,
taken without blocking, so of several processes racing for a GPU exactly one wins. The OS drops
the lock when its owner exits, however it exits (SIGKILL included), so a dead job never keeps a
GPU. The owner's pid is kept beside the lock (``<uuid>.owner``) for messages only; the lock is the
truth. The claim directory is ``GPUKIT_CLAIM_DIR`` or ``<temp dir>/gpukit-claims``; every user
of a machine must share it for claims to see each other (the default does).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from gpukit._util.envvars import CLAIM_DIR_ENV
from gpukit.errors import DeviceError

if TYPE_CHECKING:
    from filelock import FileLock

__all__ = ["CLAIM_DIR_ENV", "claim_holders", "claim_owners", "default_claim_dir"]

# A selection probe may hold a lock for microseconds; a claimer retries this long before
# concluding that the GPU is taken.
_CONTENTION_GRACE_S = 0.05


def default_claim_dir(claim_dir: str | os.PathLike[str] | None = None) -> Path:
    """The claim directory: ``claim_dir``, else ``GPUKIT_CLAIM_DIR``, else ``<temp dir>/gpukit-claims``."""
    chosen = claim_dir or os.environ.get(CLAIM_DIR_ENV)
    if not chosen:
        import tempfile  # lazily: `gpukit ls` should start fast

        chosen = Path(tempfile.gettempdir()) / "gpukit-claims"
    return Path(chosen)


def _claim_dir_error(path: Path, problem: str) -> DeviceError:
    return DeviceError(f"GPU claim directory {str(path)!r}: {problem}. Set {CLAIM_DIR_ENV} to a writable directory "
                       "shared by all jobs on this machine (every job must use the same one).")


def _ensure_dir(path: Path) -> Path:
    """``path``, created if missing; a DeviceError if it cannot hold claims (not a directory, not writable)."""
    if path.exists() and not path.is_dir():
        raise _claim_dir_error(path, "it exists but is not a directory")
    if not path.is_dir():
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _claim_dir_error(path, f"cannot create it ({exc.strerror or exc})") from None
        try:  # shared by every user of the machine, like /tmp itself: world-writable + sticky
            os.chmod(path, 0o1777)
        except OSError:  # created meanwhile by another user, who set the mode
            pass
    if not os.access(path, os.W_OK | os.X_OK):
        raise _claim_dir_error(path, "not writable by this user, so no GPU can be claimed")
    return path


def _stem(uuid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", uuid)


def _lock(directory: Path, uuid: str) -> FileLock:
    from filelock import FileLock  # lazily: `gpukit ls` imports this module only when claims exist

    # mode 0o666: other users must be able to open (and so contend for) a lock file we created
    return FileLock(str(directory / f"{_stem(uuid)}.lock"), mode=0o666, thread_local=False)


def _read_owner_info(directory: Path, uuid: str) -> dict[str, Any] | None:
    """The owner note: pid, host, since, command, and (under gpukit run) run and rank."""
    try:
        data = json.loads((directory / f"{_stem(uuid)}.owner").read_text())
        data["pid"] = int(data["pid"])
        return data if isinstance(data, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_owner(directory: Path, uuid: str) -> int | None:
    info = _read_owner_info(directory, uuid)
    return None if info is None else info["pid"]


def _write_owner(directory: Path, uuid: str, **extra: Any) -> None:
    import socket

    target = directory / f"{_stem(uuid)}.owner"
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": " ".join(sys.argv),
            **extra}
    try:
        tmp = directory / f".{target.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, target)
    except OSError:  # e.g. another user's stale file in the sticky dir: the owner is then "unknown"
        pass


def _try_acquire(directory: Path, uuid: str) -> Any | None:
    from filelock import Timeout

    lock = _lock(directory, uuid)
    try:
        lock.acquire(timeout=_CONTENTION_GRACE_S, poll_interval=0.01)
    except Timeout:
        return None
    except OSError as exc:  # read-only file system, a directory where the lock file goes, permissions
        where = directory / f"{_stem(uuid)}.lock"
        fix = " (remove that directory)" if isinstance(exc, IsADirectoryError) else ""
        raise _claim_dir_error(directory, f"cannot take the lock {where.name}: {exc.strerror or exc}{fix}") from None
    _write_owner(directory, uuid)
    return lock


def claim_holders(uuids: Iterable[str], claim_dir: str | os.PathLike[str] | None = None) -> dict[str, int | None]:
    """Which of ``uuids`` another process (or another claim of this one) holds: UUID -> owner pid.

    Owner pids are ``None`` when unknown. GPUs never claimed (no lock file) cost one ``stat``.
    """
    return {uuid: None if info is None else info["pid"] for uuid, info in claim_owners(uuids, claim_dir).items()}


def claim_owners(uuids: Iterable[str], claim_dir: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any] | None]:
    """Like :func:`claim_holders`, with the owner's note: UUID -> ``{"pid", "host", "since",
    "command"}`` plus ``"run"`` and ``"rank"`` for GPUs claimed by ``gpukit run`` (``None``: unknown).
    """
    directory = default_claim_dir(claim_dir)
    held: dict[str, dict[str, Any] | None] = {}
    for uuid in uuids:
        if not (directory / f"{_stem(uuid)}.lock").exists():
            continue
        from filelock import Timeout

        probe = _lock(directory, uuid)
        try:
            probe.acquire(blocking=False)
        except Timeout:
            held[uuid] = _read_owner_info(directory, uuid)
        except OSError:  # unreadable lock file (permissions): treat as held, safest
            held[uuid] = _read_owner_info(directory, uuid)
        else:
            probe.release()
    return held
