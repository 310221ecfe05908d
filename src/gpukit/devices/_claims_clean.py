"""Cleaning a claim folder (``gpukit claims clean``): leftovers, stale or planted claims, and the
repairs ``gpukit claims setup`` shares.

:func:`clean_folder` removes leftovers -- tickets of waiters that are gone, notes of claims that
ended, unfinished temporary files, symlinks/FIFOs/folders where gpukit keeps files, and in a shared
folder everything else that is not a file gpukit keeps there (a flood of junk) -- and names every
claim whose holder runs nothing on its GPU (:func:`stale_claims`). A claim whose holder is alive is
freed only with ``force``: a fresh lock file is put in place of the held one (the holder keeps a
lock on a file nobody else opens). A lock is never replaced while its holder's account runs
something on that GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from typing import Any

from gpukit._util.safe_files import UnsafeEntry, create_entry, kind_of, open_entry, try_flock, user_name
from gpukit.devices._claim_dir import ClaimFolder
from gpukit.devices._claim_files import claim_owners, flock_holders, holder_text, lock_name
from gpukit.devices._snapshot import GpuSnapshot, selectable_units
from gpukit.errors import DeviceError

__all__ = ["MARKER", "STALE_AFTER_S", "age_text", "claim_units", "clean_folder", "fix_lock", "holder_of", "leftovers",
           "is_claim_folder", "remove_entry", "stale_claims"]

#: A claim whose holder's account has run nothing on its GPU for this long is reported as stale.
STALE_AFTER_S = 600.0
_NOTE = re.compile(r"^(?P<stem>[A-Za-z0-9._-]+)\.(?P<pid>[0-9]{1,10})\.owner$")
_TEMP_AGE_S = 60.0


def age_text(seconds: float) -> str:
    """``42 s``, ``12 min``, ``3.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def claim_units(gpus: list[GpuSnapshot]) -> list[GpuSnapshot]:
    """The units (GPUs, MIG devices) a claim can name: those with a UUID."""
    return [u for u in selectable_units(gpus) if u.uuid is not None]


def stale_claims(folder: ClaimFolder, gpus: list[GpuSnapshot], older_than_s: float | None = None,
                 owners: dict[str, dict[str, Any] | None] | None = None) -> list[tuple[GpuSnapshot, dict[str, Any]]]:
    """Held claims whose holder's account runs nothing on that GPU, held for ``older_than_s``
    (default :data:`STALE_AFTER_S`) or more."""
    older_than_s = STALE_AFTER_S if older_than_s is None else older_than_s
    owners = claim_owners([u.uuid or "" for u in claim_units(gpus)], folder=folder) if owners is None else owners
    out = []
    now = time.time()
    for unit in claim_units(gpus):
        owner = owners.get(unit.uuid or "")
        if not owner or owner.get("blocked") or owner.get("pid") is None:
            continue
        user = owner.get("user")
        since = owner.get("since")
        if user is None or since is None or now - since < older_than_s:
            continue
        if any(p.user == user for p in unit.processes) or any(p.pid == owner["pid"] for p in unit.processes):
            continue
        out.append((unit, {**owner, "age_s": now - since}))
    return out


def holder_of(owner: dict[str, Any]) -> str:
    """``bob's pid 42`` (and the pid that took the lock, when it has exited)."""
    took = f" (inherited from pid {owner['took_it']}, which has exited)" if owner.get("inherited") else ""
    return f"{owner['user']}'s pid {owner['pid']}{took}"


def _replace_lock(folder: ClaimFolder, name: str) -> None:
    """Put a fresh lock file (0644, this process's) at ``name``, atomically (rename over what is there)."""
    import secrets

    temp = f".tmp.{secrets.token_hex(16)}"
    fd = create_entry(folder.fd, temp, 0o644)
    try:
        os.rename(temp, name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=folder.fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def remove_entry(folder: ClaimFolder, name: str) -> None:
    info = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=folder.fd)  # fd-based: never follows a symlink inside
    else:
        os.unlink(name, dir_fd=folder.fd)


def fix_lock(folder: ClaimFolder, uuid: str, actions: list[str], force_held: bool = False) -> None:
    """As the folder's owner: make ``uuid``'s lock entry a regular file of the owner's.

    A lock file of anyone else's is replaced whatever its state: gpukit never claims through one,
    so nobody's claim hangs on it. The owner's own is replaced only with ``force_held`` (a stale
    or planted claim being freed).
    """
    name = lock_name(uuid)
    try:
        fd, info = open_entry(folder.fd, name)
    except FileNotFoundError:
        os.close(create_entry(folder.fd, name, 0o644))
        actions.append(f"made {name}")
        return
    except UnsafeEntry as exc:
        remove_entry(folder, name)
        actions.append(f"removed {name}: it was {exc.kind} made by {user_name(exc.owner_uid)}")
        fix_lock(folder, uuid, actions)
        return
    except PermissionError:  # another user's file this account cannot read
        owner = os.stat(name, dir_fd=folder.fd, follow_symlinks=False).st_uid
        _replace_lock(folder, name)
        actions.append(f"replaced {name} (an unreadable file of {user_name(owner)}'s)")
        return
    os.close(fd)
    if info.st_uid == folder.info.owner_uid and not force_held:
        return
    _replace_lock(folder, name)
    actions.append(f"put a fresh lock file in place of {name}" if info.st_uid == folder.info.owner_uid
                   else f"replaced {name} (it belonged to {user_name(info.st_uid)}) by one of "
                        f"{user_name(folder.info.owner_uid)}'s")


def clean_folder(folder: ClaimFolder, gpus: list[GpuSnapshot], *, older_than_s: float = STALE_AFTER_S,
                 dry_run: bool = False, force: bool = False) -> list[str]:
    """Remove leftovers (dead tickets, notes of processes that hold nothing, stale temp files,
    symlinks/FIFOs/folders planted with claim names, anything else that is not a file gpukit keeps
    there) and name the claims held ``older_than_s`` or more whose holder's account runs nothing on
    that GPU; with ``force``, as root (or in this user's own folder), free those GPUs. Without
    ``force`` no claim whose holder is alive (or cannot be seen) is ever freed. Another account's
    files are touched only by root. Returns what it did (with ``dry_run``: would do), leftovers
    summed up per owner and reason.

    Raises:
        DeviceError: ``force`` by an account that may not free others' claims here.
    """
    me = os.geteuid()
    mine_all = me == 0 or folder.info.owner_uid == me
    if force and not mine_all:
        raise DeviceError(f"gpukit claims clean --force frees other users' claims: run it as root (sudo), or as the "
                          f"owner of {folder.path}.")
    actions: list[str] = []
    for unit, owner in stale_claims(folder, gpus, older_than_s):
        where = (f"{unit.label}: claimed by {holder_of(owner)} for {age_text(owner['age_s'])} with nothing of "
                 f"{owner['user']}'s running on it")
        if not force:
            actions.append(f"kept {where}; its holder is alive, so only --force frees it (ask {owner['user']} "
                           f"or end pid {owner['pid']} first if you can)")
            continue
        if not dry_run:
            fix_lock(folder, unit.uuid or "", [], force_held=True)
        actions.append(f"freed {where}")
    if force:
        actions += _free_hidden(folder, gpus, dry_run)
    counts: dict[tuple[str, int], int] = {}
    for name, reason, uid in leftovers(folder, None if mine_all else me):
        if not dry_run:
            try:
                remove_entry(folder, name)
            except OSError as exc:
                actions.append(f"could not remove {name}: {exc.strerror or exc}")
                continue
        counts[(reason, uid)] = counts.get((reason, uid), 0) + 1
        if counts[(reason, uid)] <= _SHOWN:
            actions.append(f"removed {name} ({reason}, by {user_name(uid)})")
    for (reason, uid), n in counts.items():
        if n > _SHOWN:
            actions.append(f"removed {n - _SHOWN} more ({reason}, by {user_name(uid)})")
    if folder.info.owner_uid == me:  # lock files others made (or none): the owner's own, unless held
        for unit in claim_units(gpus):
            fixes: list[str] = []
            if dry_run:
                continue
            try:
                fix_lock(folder, unit.uuid or "", fixes)
            except OSError as exc:
                fixes.append(f"could not fix {lock_name(unit.uuid or '')}: {exc.strerror or exc}")
            actions += [f for f in fixes if not f.startswith("made ")]
    return actions


_SHOWN = 5  # leftovers named one by one per owner and reason; the rest are counted


def _free_hidden(folder: ClaimFolder, gpus: list[GpuSnapshot], dry_run: bool) -> list[str]:
    """With --force: free claims whose holder cannot be found (the pid that took it has exited and no
    process visible here holds it open: another pid namespace)."""
    owners = claim_owners([u.uuid or "" for u in claim_units(gpus)], folder=folder)
    out = []
    for unit in claim_units(gpus):
        owner = owners.get(unit.uuid or "")
        if owner and owner.get("hidden") and not any(p.pid for p in unit.processes):
            if not dry_run:
                fix_lock(folder, unit.uuid or "", [], force_held=True)
            out.append(f"freed {unit.label}: {holder_text(owner)}")
    return out


def leftovers(folder: ClaimFolder, only_uid: int | None = None) -> list[tuple[str, str, int]]:
    """``(name, why, owner uid)`` of each file ``clean_folder`` removes (of ``only_uid``'s, when given).

    In a shared folder that ``claims setup`` made (:func:`is_claim_folder`) that includes every
    entry that is not a file gpukit keeps there (a flood of junk); elsewhere only gpukit's own
    leftovers, so a claim folder set to a busy folder by mistake (``/tmp``, a home) loses nothing else.
    """
    kernel = flock_holders()
    now = time.time()
    out = []
    sweep = is_claim_folder(folder)
    with os.scandir(folder.fd) as entries:
        names = [e.name for _, e in zip(range(_MAX_NAMES), entries)]
    found: list[tuple[str, os.stat_result]] = []
    temps: dict[int, int] = {}
    for name in names:
        try:
            info = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except OSError:
            continue
        if only_uid is not None and info.st_uid != only_uid:
            continue
        found.append((name, info))
        if name.startswith(".tmp."):
            temps[info.st_uid] = temps.get(info.st_uid, 0) + 1
    for name, info in found:
        if sweep and name.startswith(".tmp.") and temps[info.st_uid] > _TEMPS_PER_USER:
            # fresh-looking temporary files by the thousand (their mtime kept young by hand) are a flood too
            out.append((name, "more unfinished temporary files than gpukit ever keeps", info.st_uid))
            continue
        reason = _leftover(folder, name, info, kernel, now, sweep)
        if reason is not None:
            out.append((name, reason, info.st_uid))
    return out


_TEMPS_PER_USER = 256  # a process has one temporary file at a time, for microseconds


#: The root-owned file ``claims setup`` leaves in the folders it makes (only there is junk swept away).
MARKER = ".gpukit-claim-folder"


def is_claim_folder(folder: ClaimFolder) -> bool:
    """Whether ``folder`` is a shared claim folder ``claims setup`` made (root-owned, sticky, with
    root's :data:`MARKER` in it), whose every other entry gpukit may remove."""
    if not folder.shared:
        return False
    try:
        info = os.stat(MARKER, dir_fd=folder.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == 0


_MAX_NAMES = 1_000_000  # one run of `claims clean` looks at this many entries (say it again for more)
_TICKET = re.compile(r"^ticket\.[A-Za-z0-9._-]{1,200}$")
_TEMP = re.compile(r"^\.tmp\.[A-Za-z0-9._-]{1,200}$")
_LOCK = re.compile(r"^[A-Za-z0-9._-]{1,200}\.lock$")


def _leftover(folder: ClaimFolder, name: str, info: os.stat_result, kernel: dict[tuple[int, int], int] | None,
              now: float, sweep: bool = False) -> str | None:
    """Why ``name`` should go, or ``None`` to keep it. ``sweep``: anything gpukit does not keep goes."""
    regular = stat.S_ISREG(info.st_mode)
    claim_like = name.endswith((".lock", ".owner")) or name.startswith(("ticket.", ".tmp."))
    if claim_like and not regular:
        return f"{kind_of(info.st_mode)} where gpukit keeps files"
    gpukits = name == MARKER or any(pattern.match(name) for pattern in (_TICKET, _TEMP, _LOCK, _NOTE))
    if sweep and not gpukits:
        return "not a file gpukit keeps here"
    if sweep and _LOCK.match(name) and info.st_uid != folder.info.owner_uid:
        return "a lock file the folder's owner did not make"
    if name.startswith(".tmp.") and now - info.st_mtime > _TEMP_AGE_S:
        return "an unfinished temporary file"
    if name.startswith("ticket."):
        try:
            fd, _ = open_entry(folder.fd, name)
        except OSError:
            return None
        try:
            return "a ticket of a waiter that is gone" if try_flock(fd, exclusive=False) else None
        finally:
            os.close(fd)
    match = _NOTE.match(name)
    if match:
        try:
            lock = os.stat(f"{match['stem']}.lock", dir_fd=folder.fd, follow_symlinks=False)
        except OSError:
            return "a note of a claim that is gone"
        if kernel is not None and kernel.get((lock.st_dev, lock.st_ino)) != int(match["pid"]):
            return "a note of a claim that is gone"
    return None
