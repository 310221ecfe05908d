"""Looking after a claim folder: the administrator's one-time set-up, a health report, and cleaning.

* :func:`setup_folder` (``sudo gpukit claims setup``) makes the machine's shared folder root-owned
  with mode 1777 and gives every GPU (and MIG device) a root-owned lock file, so no user can remove
  a lock another user holds, or plant one.
* :func:`survey` finds what ``gpukit ls`` and ``gpukit doctor`` report: claims held by a process
  whose account runs nothing on that GPU (stale or planted), lock entries another user planted
  (a symlink, a FIFO, an unreadable file), ignored queue tickets, leftover files.
* :func:`clean_folder` (``gpukit claims clean``) removes leftovers -- everything in the folder that
  is not a file gpukit keeps there, so a flood of junk goes too -- and names every claim whose
  holder runs nothing on its GPU. A claim whose holder is alive is freed only with ``force``
  (``--force``): as root (or in this user's own folder), a fresh lock file is put in place of the
  held one (the holder keeps a lock on a file nobody else opens). A lock is never replaced while
  its holder's account runs something on that GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from gpukit._util.safe_files import (
    OPEN_FLAGS, UnsafeEntry, create_entry, folder_info, kind_of, open_entry, try_flock, user_name, walk_folder,
)
from gpukit.devices._claim_dir import SYSTEM_CLAIM_DIR, ClaimFolder
from gpukit.devices._claim_files import claim_owners, flock_holders, holder_text, lock_name
from gpukit.devices._queue import read_queue
from gpukit.devices._snapshot import GpuSnapshot, selectable_units
from gpukit.errors import DeviceError

__all__ = ["ClaimState", "Problem", "STALE_AFTER_S", "clean_folder", "kernel_problem", "read_claim_state", "setup_folder",
           "survey"]

#: A claim whose holder's account has run nothing on its GPU for this long is reported as stale.
STALE_AFTER_S = 600.0
_NOTE = re.compile(r"^(?P<stem>[A-Za-z0-9._-]+)\.(?P<pid>[0-9]{1,10})\.owner$")
_TEMP_AGE_S = 60.0
#: The kernel setting that stops a user from hard-linking files they cannot write (the queue's order needs it).
PROTECTED_HARDLINKS = "/proc/sys/fs/protected_hardlinks"


@dataclass
class Problem:
    """One thing worth telling: ``what`` in words, ``fix`` (a command), and machine-readable ``details``."""

    what: str
    fix: str | None = None
    severity: str = "warn"  # "info", "warn", or "fail" (a GPU cannot be claimed)
    details: dict[str, Any] = field(default_factory=dict)


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _units(gpus: list[GpuSnapshot]) -> list[GpuSnapshot]:
    return [u for u in selectable_units(gpus) if u.uuid is not None]


def stale_claims(folder: ClaimFolder, gpus: list[GpuSnapshot], older_than_s: float | None = None,
                 owners: dict[str, dict[str, Any] | None] | None = None) -> list[tuple[GpuSnapshot, dict[str, Any]]]:
    """Held claims whose holder's account runs nothing on that GPU, held for ``older_than_s``
    (default :data:`STALE_AFTER_S`) or more."""
    older_than_s = STALE_AFTER_S if older_than_s is None else older_than_s
    owners = claim_owners([u.uuid or "" for u in _units(gpus)], folder=folder) if owners is None else owners
    out = []
    now = time.time()
    for unit in _units(gpus):
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


def kernel_problem() -> Problem | None:
    """What is wrong with the kernel's protection of a shared folder (``None`` when nothing is).

    The queue is ordered by each ticket's change time, which no user can set back -- but a new hard
    link to a file also resets its change time, so where the kernel lets anyone hard-link files they
    cannot write (``fs.protected_hardlinks = 0``) another user can send a waiter to the back of the
    queue. Linux distributions turn the protection on by default (systemd's sysctl settings).
    """
    try:
        with open(PROTECTED_HARDLINKS, "rb") as handle:
            value = handle.read(16).strip()
    except OSError:
        return None  # not Linux, or no /proc: nothing known
    if value != b"0":
        return None
    return Problem("the kernel lets any user hard-link files they cannot write (fs.protected_hardlinks = 0): "
                   "another user can then send a waiter to the back of the shared queue (a new link resets the "
                   "change time of its ticket, which orders the queue)",
                   "sudo sysctl -w fs.protected_hardlinks=1, and keep it in /etc/sysctl.d/ (most distributions' "
                   "default)", "warn", {"setting": "fs.protected_hardlinks", "value": 0})


def survey(folder: ClaimFolder, gpus: list[GpuSnapshot], owners: dict[str, dict[str, Any] | None] | None = None,
           ignored: list[str] | None = None) -> list[Problem]:
    """What is wrong in ``folder`` now (see the module docstring); ``[]`` when nothing is.

    ``owners`` (from :func:`claim_owners`) and ``ignored`` (from :func:`read_queue`): when the
    caller has them already.
    """
    problems: list[Problem] = []
    kernel = kernel_problem() if folder.shared else None
    if kernel is not None:
        problems.append(kernel)
    units = _units(gpus)
    owners = claim_owners([u.uuid or "" for u in units], folder=folder) if owners is None else owners
    clean = "sudo gpukit claims clean" if folder.shared or folder.info.owner_uid == 0 else "gpukit claims clean"
    for unit in units:
        owner = owners.get(unit.uuid or "")
        if owner and owner.get("blocked"):
            problems.append(Problem(f"{unit.label} cannot be claimed: {owner['blocked']}", clean, "fail",
                                    {"uuid": unit.uuid, "user": owner.get("user")}))
    for unit, owner in stale_claims(folder, gpus, owners=owners):
        problems.append(Problem(
            f"{unit.label} is claimed by {_who(owner)} for {_age(owner['age_s'])}, but {owner['user']} runs "
            "nothing on it: a stale or planted claim (or a job still preparing its data)",
            f"ask {owner['user']}, or end pid {owner['pid']}, or free it: {clean} --force", "warn",
            {"uuid": unit.uuid, "pid": owner["pid"], "user": owner["user"], "age_s": round(owner["age_s"])}))
    for unit in units:
        owner = owners.get(unit.uuid or "")
        if owner and owner.get("hidden"):
            problems.append(Problem(f"{unit.label} is {holder_text(owner)}", f"{clean} (as root it names the "
                                    "holder)", "warn", {"uuid": unit.uuid, "took_it": owner.get("took_it")}))
    if ignored is None:
        try:
            _tickets, ignored = read_queue(folder, len(units))
        except OverflowError as exc:
            ignored = [str(exc)]
    for text in ignored:
        problems.append(Problem(f"queue entry ignored: {text}", clean, "info"))
    left = leftovers(folder)
    if left:
        users = sorted({user_name(uid) for _, _, uid in left})
        shown = "; ".join(f"{name} ({why})" for name, why, _ in left[:3]) + ("; ..." if len(left) > 3 else "")
        fix = "gpukit claims clean" if all(uid == os.geteuid() for _, _, uid in left) else clean
        problems.append(Problem(f"{len(left)} leftover file(s) of {', '.join(users)} in {folder.path}: {shown}",
                                fix, "info", {"files": [name for name, _, _ in left]}))
    return problems


def _who(owner: dict[str, Any]) -> str:
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


def _remove_entry(folder: ClaimFolder, name: str) -> None:
    info = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=folder.fd)  # fd-based: never follows a symlink inside
    else:
        os.unlink(name, dir_fd=folder.fd)


def _fix_lock(folder: ClaimFolder, uuid: str, actions: list[str], force_held: bool = False) -> None:
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
        _remove_entry(folder, name)
        actions.append(f"removed {name}: it was {exc.kind} made by {user_name(exc.owner_uid)}")
        _fix_lock(folder, uuid, actions)
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


def setup_folder(path: os.PathLike[str] | str = SYSTEM_CLAIM_DIR, gpus: list[GpuSnapshot] | None = None) -> list[str]:
    """Make ``path`` the machine's shared claim folder (run as root); returns what it did.

    Raises:
        DeviceError: not root, or the folder cannot be made.
    """
    from pathlib import Path

    if os.geteuid() != 0:
        raise DeviceError("`gpukit claims setup` makes a folder every user shares, owned by root: run it as root "
                          "(sudo gpukit claims setup).")
    target = Path(path)
    if not target.is_absolute():
        raise DeviceError(f"gpukit claims setup --dir {str(target)!r}: give an absolute path.")
    actions: list[str] = []
    try:
        # every component from / on: no symlink or folder another user controls (a planted parent
        # would have root make a world-writable folder wherever that user points it)
        parent = walk_folder(target.parent, make_mode=0o755, strict=True)
        try:
            try:
                info = os.stat(target.name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                os.mkdir(target.name, 0o700, dir_fd=parent)
                actions.append(f"made {target}")
                info = os.stat(target.name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                raise DeviceError(f"{target} is {kind_of(info.st_mode)} made by {user_name(info.st_uid)}, not a "
                                  "folder; remove it and run `sudo gpukit claims setup` again.")
            fd = os.open(target.name, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
    except UnsafeEntry as exc:
        raise DeviceError(
            f"gpukit claims setup --dir {target}: {exc.name} is {exc.kind} of {user_name(exc.owner_uid)}'s, who could "
            "then redirect or replace the shared folder root makes; choose a path whose folders only root controls "
            "(the default /var/lib/gpukit/claims), or remove it.") from None
    except OSError as exc:
        raise DeviceError(f"gpukit claims setup: cannot make {target}: {exc.strerror or exc}.") from None
    folder = ClaimFolder(target, fd, folder_info(fd), "shared")
    with folder:
        before = os.fstat(fd)
        if before.st_uid != 0 or before.st_gid != 0:
            os.fchown(fd, 0, 0)
            actions.append(f"gave {target} to root (it belonged to {user_name(before.st_uid)})")
        if stat.S_IMODE(before.st_mode) != 0o1777:
            os.fchmod(fd, 0o1777)
            actions.append(f"set {target} to mode 1777 (was {stat.S_IMODE(before.st_mode):04o})")
        if before.st_uid != 0 or stat.S_IMODE(before.st_mode) & 0o7777 != 0o1777:
            # taken over: whatever another account put here while the folder was not a safe shared one
            # (a live ticket at the head of the queue, notes, junk) goes
            actions += _remove_others(folder)
        for unit in _units(gpus if gpus is not None else _list()):
            _fix_lock(folder, unit.uuid or "", actions)
    return actions


def _remove_others(folder: ClaimFolder) -> list[str]:
    """Remove every entry of the folder that root did not make; what was removed, one line per owner."""
    removed: dict[int, int] = {}
    with os.scandir(folder.fd) as entries:
        names = [e.name for e in entries]
    for name in names:
        try:
            info = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
            if info.st_uid == 0:
                continue
            _remove_entry(folder, name)
        except OSError:
            continue
        removed[info.st_uid] = removed.get(info.st_uid, 0) + 1
    return [f"removed {n} file(s) {user_name(uid)} made before the folder was shared" for uid, n in removed.items()]


def _list() -> list[GpuSnapshot]:
    from gpukit.devices._snapshot import list_gpus

    return list_gpus()


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
        where = (f"{unit.label}: claimed by {_who(owner)} for {_age(owner['age_s'])} with nothing of "
                 f"{owner['user']}'s running on it")
        if not force:
            actions.append(f"kept {where}; its holder is alive, so only --force frees it (ask {owner['user']} "
                           f"or end pid {owner['pid']} first if you can)")
            continue
        if not dry_run:
            _fix_lock(folder, unit.uuid or "", [], force_held=True)
        actions.append(f"freed {where}")
    if force:
        actions += _free_hidden(folder, gpus, dry_run)
    counts: dict[tuple[str, int], int] = {}
    for name, reason, uid in leftovers(folder, None if mine_all else me):
        if not dry_run:
            try:
                _remove_entry(folder, name)
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
        for unit in _units(gpus):
            fixes: list[str] = []
            if dry_run:
                continue
            try:
                _fix_lock(folder, unit.uuid or "", fixes)
            except OSError as exc:
                fixes.append(f"could not fix {lock_name(unit.uuid or '')}: {exc.strerror or exc}")
            actions += [f for f in fixes if not f.startswith("made ")]
    return actions


_SHOWN = 5  # leftovers named one by one per owner and reason; the rest are counted


def _free_hidden(folder: ClaimFolder, gpus: list[GpuSnapshot], dry_run: bool) -> list[str]:
    """With --force: free claims whose holder cannot be found (the pid that took it has exited and no
    process visible here holds it open: another pid namespace)."""
    owners = claim_owners([u.uuid or "" for u in _units(gpus)], folder=folder)
    out = []
    for unit in _units(gpus):
        owner = owners.get(unit.uuid or "")
        if owner and owner.get("hidden") and not any(p.pid for p in unit.processes):
            if not dry_run:
                _fix_lock(folder, unit.uuid or "", [], force_held=True)
            out.append(f"freed {unit.label}: {holder_text(owner)}")
    return out


def leftovers(folder: ClaimFolder, only_uid: int | None = None) -> list[tuple[str, str, int]]:
    """``(name, why, owner uid)`` of each file ``clean_folder`` removes (of ``only_uid``'s, when given).

    In a shared folder (or any root-owned one, looked at by root) that includes every entry that is
    not a file gpukit keeps there (a flood of junk); in a user's own folder only gpukit's own
    leftovers, so a claim folder set to a busy folder by mistake loses nothing else.
    """
    kernel = flock_holders()
    now = time.time()
    out = []
    sweep = folder.shared or (folder.info.owner_uid == 0 and os.geteuid() == 0)
    with os.scandir(folder.fd) as entries:
        names = [e.name for _, e in zip(range(_MAX_NAMES), entries)]
    for name in names:
        try:
            info = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except OSError:
            continue
        if only_uid is not None and info.st_uid != only_uid:
            continue
        reason = _leftover(folder, name, info, kernel, now, sweep)
        if reason is not None:
            out.append((name, reason, info.st_uid))
    return out


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
    gpukits = any(pattern.match(name) for pattern in (_TICKET, _TEMP, _LOCK, _NOTE))
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


@dataclass
class ClaimState:
    """Everything ``gpukit ls`` and ``gpukit doctor`` show about claims, read once.

    ``folder``: the claim folder's path (``None``: none yet); ``shared``: every user's claims meet
    there; ``notice``: what to say when claims protect only this user's jobs; ``owners``: UUID ->
    holder (as :func:`claim_owners`); ``queue``: live tickets, oldest first; ``problems``: see
    :func:`survey`; ``error``: why the folder cannot be used at all (then nothing else is read).
    """

    folder: str | None = None
    shared: bool = False
    notice: str | None = None
    owners: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    queue: list[Any] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    error: str | None = None


def read_claim_state(gpus: list[GpuSnapshot], claim_dir: str | os.PathLike[str] | None = None,
         named: str = "claim_dir=") -> ClaimState:
    """Read the claim folder for a report; never raises for what is in it (see :class:`ClaimState`).
    ``named``: how messages call ``claim_dir``."""
    from gpukit.devices._claim_dir import _per_user as _per_user_dir
    from gpukit.devices._claim_dir import default_claim_dir, open_claim_folder, private_notice
    from gpukit.errors import GpukitError

    state = ClaimState()
    try:
        folder = open_claim_folder(claim_dir, create=False, named=named)
    except FileNotFoundError:
        path = default_claim_dir(claim_dir)
        made_by_root = os.geteuid() == 0 and path != _per_user_dir()  # root makes a named folder shared (1777)
        state.folder, state.notice = str(path), None if made_by_root else private_notice(path)
        return state
    except GpukitError as exc:
        state.error = str(exc)
        return state
    with folder:
        state.folder, state.shared, state.notice = str(folder.path), folder.shared, private_notice(folder)
        units = _units(gpus)
        state.owners = claim_owners([u.uuid or "" for u in units], folder=folder)
        try:
            state.queue, ignored = read_queue(folder, len(units))
        except OverflowError as exc:
            ignored = [str(exc)]
        state.problems = survey(folder, gpus, state.owners, ignored)
    return state
