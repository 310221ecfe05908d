"""Looking after a claim folder: the administrator's one-time set-up, a health report, and cleaning.

* :func:`setup_folder` (``sudo gpukit claims setup``) makes the machine's shared folder root-owned
  with mode 1777 and gives every GPU (and MIG device) a root-owned lock file, so no user can remove
  a lock another user holds, or plant one.
* :func:`survey` finds what ``gpukit ls`` and ``gpukit doctor`` report: claims held by a process
  whose account runs nothing on that GPU (stale or planted), lock entries another user planted
  (a symlink, a FIFO, an unreadable file), ignored queue tickets, leftover files.
* cleaning (``gpukit claims clean``): :mod:`gpukit.devices._claims_clean`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

from gpukit._util.safe_files import OPEN_FLAGS, UnsafeEntry, create_entry, folder_info, kind_of, user_name, walk_folder
from gpukit.devices._claim_dir import SYSTEM_CLAIM_DIR, ClaimFolder
from gpukit.devices._claim_files import claim_owners, holder_text
from gpukit.devices._claims_clean import (
    MARKER, age_text, claim_units, fix_lock, holder_of, leftovers, remove_entry, stale_claims,
)
from gpukit.devices._queue import read_queue
from gpukit.devices._snapshot import GpuSnapshot
from gpukit.errors import DeviceError

__all__ = ["ClaimState", "Problem", "kernel_problem", "read_claim_state", "setup_folder", "survey"]

#: The kernel setting that stops a user from hard-linking files they cannot write (the queue's order needs it).
PROTECTED_HARDLINKS = "/proc/sys/fs/protected_hardlinks"


@dataclass
class Problem:
    """One thing worth telling: ``what`` in words, ``fix`` (a command), and machine-readable ``details``."""

    what: str
    fix: str | None = None
    severity: str = "warn"  # "info", "warn", or "fail" (a GPU cannot be claimed)
    details: dict[str, Any] = field(default_factory=dict)


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
    units = claim_units(gpus)
    owners = claim_owners([u.uuid or "" for u in units], folder=folder) if owners is None else owners
    clean = "sudo gpukit claims clean" if folder.shared or folder.info.owner_uid == 0 else "gpukit claims clean"
    for unit in units:
        owner = owners.get(unit.uuid or "")
        if owner and owner.get("blocked"):
            problems.append(Problem(f"{unit.label} cannot be claimed: {owner['blocked']}", clean, "fail",
                                    {"uuid": unit.uuid, "user": owner.get("user")}))
    for unit, owner in stale_claims(folder, gpus, owners=owners):
        problems.append(Problem(
            f"{unit.label} is claimed by {holder_of(owner)} for {age_text(owner['age_s'])}, but {owner['user']} runs "
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
        _mark(folder, actions)
        for unit in claim_units(gpus if gpus is not None else _list()):
            fix_lock(folder, unit.uuid or "", actions)
    return actions


def _mark(folder: ClaimFolder, actions: list[str]) -> None:
    """Leave root's :data:`MARKER` (only in a folder setup made does `claims clean` sweep away what is
    not gpukit's); one another user planted under its name goes first."""
    try:
        info = os.stat(MARKER, dir_fd=folder.fd, follow_symlinks=False)
        if stat.S_ISREG(info.st_mode) and info.st_uid == 0:
            return
        remove_entry(folder, MARKER)
        actions.append(f"removed {MARKER} ({kind_of(info.st_mode)} of {user_name(info.st_uid)}'s)")
    except FileNotFoundError:
        pass
    os.close(create_entry(folder.fd, MARKER, 0o644))


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
            remove_entry(folder, name)
        except OSError:
            continue
        removed[info.st_uid] = removed.get(info.st_uid, 0) + 1
    return [f"removed {n} file(s) {user_name(uid)} made before the folder was shared" for uid, n in removed.items()]


def _list() -> list[GpuSnapshot]:
    from gpukit.devices._snapshot import list_gpus

    return list_gpus()


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
        units = claim_units(gpus)
        state.owners = claim_owners([u.uuid or "" for u in units], folder=folder)
        try:
            state.queue, ignored = read_queue(folder, len(units))
        except OverflowError as exc:
            ignored = [str(exc)]
        state.problems = survey(folder, gpus, state.owners, ignored)
    return state
