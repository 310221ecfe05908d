"""The claim folder's files: a lock per GPU, the claimer's note, and who holds which GPU.

A claim is ``flock`` on ``<claim folder>/<GPU UUID>.lock``, taken without blocking, so of several
processes racing for a GPU exactly one wins, and the OS drops it when its owner exits however it
exits (SIGKILL included). Lock files are opened read-only (``flock`` needs no more), without
following symlinks, regular files only (:mod:`gpukit._util.safe_files`), and a lock whose file was
removed or replaced while it was being taken is taken again. Only lock files owned by the folder's
owner are used, and only the folder's owner makes them: ``sudo gpukit claims setup`` makes a
root-owned one per GPU in the shared folder, so no user can remove a lock another user holds
(a user's lock file there could be removed by that user while someone else holds it, and the
next claimer would get the GPU); in a user's own folder, that user makes them as needed.

Who holds a lock comes from the kernel (``/proc/locks``: the pid that took it), not from a file
anyone could write. A lock outlives the process that took it when a child it forked keeps the file
open; then the holder is the process that has it open now (found in ``/proc/<pid>/fd``: root sees
every process, a user only their own), named with the pid that took it. The holder's note ``<uuid>.<pid>.owner`` (host, since, command, and under
``gpukit run`` the run and rank) adds detail for messages; it is believed only when written by the
holder's own account. Everything read is bounded and checked, and shown only through
:func:`gpukit._util.text.printable`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Any, Iterable

from gpukit._util.host import host_name
from gpukit._util.safe_files import (
    UnsafeEntry, create_entry, open_entry, read_bounded, same_file, try_flock, user_name, write_note,
)
from gpukit.devices._claim_dir import (
    CLAIM_DIR_ENV, SYSTEM_CLAIM_DIR, ClaimFolder, default_claim_dir, open_claim_folder,
)
from gpukit.errors import DeviceError

__all__ = ["CLAIM_DIR_ENV", "claim_holders", "claim_owners", "default_claim_dir"]

# A probe holds a shared lock for microseconds; a claimer retries this long before concluding
# that the GPU is taken.
_CONTENTION_GRACE_S = 0.05
_NOTE_MAX_BYTES = 8192
_PROC_LOCKS_MAX_BYTES = 16 << 20
_SETUP = "sudo gpukit claims setup"


def _stem(uuid: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", uuid)[:200]


def lock_name(uuid: str) -> str:
    return f"{_stem(uuid)}.lock"


def note_name(uuid: str, pid: int) -> str:
    return f"{_stem(uuid)}.{pid}.owner"


def acquire(folder: ClaimFolder, uuid: str) -> int | None:
    """``flock`` the GPU's lock file: its descriptor (held until closed), or ``None`` when another
    process holds it or the entry cannot be used (see :func:`usable_lock`).

    Raises:
        DeviceError: the folder refuses files (read-only file system, permissions).
    """
    name = lock_name(uuid)
    deadline = time.monotonic() + _CONTENTION_GRACE_S
    while True:
        try:
            fd, info = open_entry(folder.fd, name)
            if info.st_uid != folder.info.owner_uid:
                os.close(fd)
                return None
        except FileNotFoundError:
            if folder.info.owner_uid != os.geteuid():
                return None  # only the folder's owner makes lock files (`gpukit claims setup` in a shared one)
            try:
                fd = create_entry(folder.fd, name, 0o644)
            except FileExistsError:
                continue
            except OSError as exc:
                raise DeviceError(f"GPU claims: cannot create {folder.path / name}: {exc.strerror or exc}. Check "
                                  f"that {folder.path} is writable, or set {CLAIM_DIR_ENV} to a folder that is.") from None
            info = os.fstat(fd)
        except (UnsafeEntry, PermissionError):
            return None  # claim_owners says whose entry it is
        if try_flock(fd):
            if same_file(folder.fd, name, info):
                return fd
            os.close(fd)  # removed or replaced while we took it: take the file that is there now
            continue
        os.close(fd)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def write_owner(folder: ClaimFolder, uuid: str, **extra: Any) -> None:
    """Write this process's note for a GPU it holds (best effort: a note is for messages only)."""
    info = {"pid": os.getpid(), "host": host_name(), "since": time.time(),
            "command": " ".join(sys.argv)[:1000], **extra}
    try:
        write_note(folder.fd, note_name(uuid, os.getpid()), json.dumps(info).encode())
    except OSError:
        pass


def remove_owner(folder: ClaimFolder, uuid: str) -> None:
    try:
        os.unlink(note_name(uuid, os.getpid()), dir_fd=folder.fd)
    except OSError:
        pass


def flock_holders() -> dict[tuple[int, int], int] | None:
    """``(st_dev, st_ino)`` -> pid of the process that holds an exclusive ``flock`` on it, from
    ``/proc/locks`` (``None`` where there is no such file; a pid outside this pid namespace is left out)."""
    try:
        fd = os.open("/proc/locks", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = b""
        while len(data) < _PROC_LOCKS_MAX_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    out: dict[tuple[int, int], int] = {}
    for line in data.decode("ascii", "replace").splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->" or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            pid = int(parts[4])
            key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        except ValueError:
            continue
        if pid > 0:
            out[key] = pid
    return out


def has_open(pid: int, key: tuple[int, int]) -> bool | None:
    """Whether process ``pid`` holds the file ``(st_dev, st_ino)`` open (``/proc/<pid>/fd``);
    ``None`` when this user may not look (another user's process, not root) or it is gone."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith("/") or not target.split(" (deleted)")[0].endswith(".lock"):
                continue  # not a lock file: skip the stat
            info = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (info.st_dev, info.st_ino) == key:
            return True
    return False


def open_by(key: tuple[int, int], limit: int = 8) -> list[int]:
    """Pids of the processes (this user may look into) that hold the file ``(st_dev, st_ino)`` open,
    from ``/proc/<pid>/fd``; at most ``limit``."""
    try:
        pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return []
    found: list[int] = []
    for pid in pids:
        if has_open(pid, key):
            found.append(pid)
            if len(found) >= limit:
                break
    return found


def _pid_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _pid_start(pid: int) -> float | None:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone, no permission, no psutil: unknown
        return None


def _short(value: Any, limit: int) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def read_note(folder_fd: int, uuid: str, pid: int, uid: int | None) -> dict[str, Any] | None:
    """The note of ``pid`` for ``uuid``, when written by ``uid``'s account; checked fields only."""
    try:
        fd, info = open_entry(folder_fd, note_name(uuid, pid))
    except OSError:
        return None
    try:
        if uid is not None and info.st_uid != uid:
            return None  # planted by another account under the holder's name
        raw = read_bounded(fd, _NOTE_MAX_BYTES)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    note: dict[str, Any] = {}
    for key, limit in (("host", 255), ("command", 1000), ("run", 200)):
        if _short(data.get(key), limit) is not None:
            note[key] = data[key][:limit]
    rank = data.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 1 << 31:
        note["rank"] = rank
    since = data.get("since")
    if isinstance(since, (int, float)) and not isinstance(since, bool) and 0 < since < 1e11:
        note["since"] = float(since)
    return note


def _describe_unusable(folder: ClaimFolder, uuid: str, exc: OSError) -> dict[str, Any]:
    owner = exc.owner_uid if isinstance(exc, UnsafeEntry) else None
    kind = exc.kind if isinstance(exc, UnsafeEntry) else "a file this user cannot read"
    if owner is None:
        try:
            owner = os.stat(lock_name(uuid), dir_fd=folder.fd, follow_symlinks=False).st_uid
        except OSError:
            pass
    return {"pid": None, "uid": owner, "user": user_name(owner),
            "blocked": f"its lock file {lock_name(uuid)} is {kind} made by {user_name(owner)}"}


def _holders_in(folder: ClaimFolder, uuids: Iterable[str]) -> dict[str, dict[str, Any] | None]:
    held: dict[str, dict[str, Any] | None] = {}
    kernel: dict[tuple[int, int], int] | None = None
    looked = False
    for uuid in uuids:
        try:
            fd, info = open_entry(folder.fd, lock_name(uuid))
        except FileNotFoundError:
            if folder.info.owner_uid != os.geteuid():
                setup = _SETUP if folder.path == SYSTEM_CLAIM_DIR else f"{_SETUP} --dir {folder.path}"
                held[uuid] = {"pid": None, "uid": None, "user": None, "missing": True,
                              "blocked": f"the shared claim folder has no lock file for it (`{setup}` makes one "
                                         "per GPU: run it again after adding GPUs or changing MIG devices)"}
            continue
        except (UnsafeEntry, PermissionError) as exc:
            held[uuid] = _describe_unusable(folder, uuid, exc)
            continue
        except OSError:
            held[uuid] = None
            continue
        if info.st_uid != folder.info.owner_uid:
            os.close(fd)
            owner = user_name(info.st_uid)
            held[uuid] = {"pid": None, "uid": info.st_uid, "user": owner,
                          "blocked": f"its lock file {lock_name(uuid)} was made by {owner}, not by the folder's owner "
                                     f"({user_name(folder.info.owner_uid)}), so {owner} could remove it while "
                                     "someone holds it"}
            continue
        try:
            if try_flock(fd, exclusive=False):
                continue  # nobody holds it
        finally:
            os.close(fd)
        if not looked:
            kernel, looked = flock_holders(), True
        pid = None if kernel is None else kernel.get((info.st_dev, info.st_ino))
        if pid is None:
            held[uuid] = None
            continue
        held[uuid] = _holder(folder, uuid, pid, (info.st_dev, info.st_ino))
    return held


def _holder(folder: ClaimFolder, uuid: str, pid: int, key: tuple[int, int]) -> dict[str, Any]:
    """The holder of ``uuid``'s lock, which the kernel says ``pid`` took."""
    uid = _pid_uid(pid)
    if uid is not None and has_open(pid, key) is False:
        uid = None  # the pid was reused by a process that does not hold the lock: the one that took it is gone
    owner: dict[str, Any] = {"pid": pid, "uid": uid, "user": user_name(uid) if uid is not None else None}
    if uid is None:  # the process that took it is gone: a child it forked holds the lock open
        owner["took_it"] = pid
        holders = open_by(key)
        if holders:
            owner["pid"] = pid = holders[0]
            uid = _pid_uid(pid)
            owner.update({"uid": uid, "user": user_name(uid) if uid is not None else None, "inherited": True})
        else:  # another user's process (only root may look into it): the note says whose claim it was
            owner["pid"] = None
            try:
                noted = os.stat(note_name(uuid, pid), dir_fd=folder.fd, follow_symlinks=False)
                owner.update({"uid": noted.st_uid, "user": user_name(noted.st_uid)})
                whose = f" ({owner['user']}'s, by its note)"
            except OSError:
                whose = ""
            owner["hidden"] = (f"pid {pid}{whose} took it and has exited; a process it forked holds it open now, "
                               "which only root can name (sudo gpukit claims clean names it)")
            return owner
    note = read_note(folder.fd, uuid, owner.get("took_it", pid), uid)
    owner.update(note or {})
    owner.setdefault("since", _pid_start(pid))
    return owner
    return held


def claim_owners(uuids: Iterable[str], claim_dir: str | os.PathLike[str] | None = None,
                 folder: ClaimFolder | None = None) -> dict[str, dict[str, Any] | None]:
    """Which of ``uuids`` are claimed: UUID -> the holder ``{"pid", "uid", "user", "since"}`` plus,
    from its note, ``"host"``, ``"command"``, and ``"run"``/``"rank"`` under ``gpukit run``
    (``None``: claimed, holder unknown). A GPU whose lock entry another user planted (a symlink,
    a FIFO, an unreadable file) counts as claimed, with ``"blocked"`` saying by whom.

    Raises:
        DeviceError: the claim folder cannot be trusted (names its owner and the fix).
    """
    if folder is not None:
        return _holders_in(folder, uuids)
    try:
        opened = open_claim_folder(claim_dir, create=False)
    except FileNotFoundError:
        return {}
    with opened:
        return _holders_in(opened, uuids)


def claim_holders(uuids: Iterable[str], claim_dir: str | os.PathLike[str] | None = None) -> dict[str, int | None]:
    """Which of ``uuids`` another process (or another claim of this one) holds: UUID -> owner pid
    (``None`` when unknown). GPUs never claimed (no lock file) cost one ``open``."""
    return {uuid: None if info is None else info["pid"] for uuid, info in claim_owners(uuids, claim_dir).items()}


def holder_text(owner: dict[str, Any] | None) -> str:
    """``claimed by pid 42 (alice)``, for "why not" reports."""
    if owner is None:
        return "claimed by another process"
    if owner.get("blocked"):
        return f"blocked: {owner['blocked']}"
    if owner.get("pid") is None:
        return f"claimed: {owner['hidden']}" if owner.get("hidden") else "claimed by another process"
    mine = " (this process)" if owner["pid"] == os.getpid() else ""
    user = f" ({owner['user']})" if owner.get("user") and not mine else ""
    took = f", inherited from pid {owner['took_it']}, which has exited" if owner.get("inherited") else ""
    return f"claimed by pid {owner['pid']}{mine}{user}{took}"
