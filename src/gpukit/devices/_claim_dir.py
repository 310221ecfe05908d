"""Where claims live, and whether that folder can be trusted.

The layout (docs/devices.md, "Shared machines"):

1. ``claim_dir=`` or ``GPUKIT_CLAIM_DIR``: an absolute path. gpukit creates it when missing: as
   root mode 1777 (shared, like ``/tmp``), as anyone else 0700 (private).
2. else the machine's shared folder :data:`SYSTEM_CLAIM_DIR` when an administrator made it once
   with ``sudo gpukit claims setup`` (root-owned, mode 1777, a root-owned lock file per GPU);
3. else a per-user folder (mode 0700) in a place no one else can create first:
   ``$XDG_RUNTIME_DIR/gpukit-claims`` when that folder is this user's own, else
   ``~/.cache/gpukit/claims-<host>`` when the home folder is this user's (per host: a home shared
   over NFS must not mix two machines' queues), else ``<temp dir>/gpukit-claims-<uid>`` (which
   another user could make first: then the error names them). Claims there keep this user's own
   jobs apart, not other users' jobs: gpukit says so once per process (:func:`private_notice`).

A folder is used only when it is trusted (:func:`gpukit._util.safe_files.folder_info`): owned by
root or by this user, and sticky when others may write in it. Another user's folder, a symlink or
a non-sticky shared folder is refused with an error that names the owner and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from gpukit._util.envvars import CLAIM_DIR_ENV
from gpukit._util.host import host_name
from gpukit._util.safe_files import OPEN_FLAGS, Folder, UnsafeEntry, folder_info, kind_of, walk_folder
from gpukit._util.text import printable
from gpukit.errors import ConfigurationError, DeviceError

__all__ = ["CLAIM_DIR_ENV", "SYSTEM_CLAIM_DIR", "ClaimFolder", "default_claim_dir", "open_claim_folder",
           "private_notice"]

#: The machine's shared claim folder, made by ``sudo gpukit claims setup``.
SYSTEM_CLAIM_DIR = Path("/var/lib/gpukit/claims")
_SETUP = "sudo gpukit claims setup"


@dataclass
class ClaimFolder:
    """An open, trusted claim folder. ``fd`` stays open until :meth:`close`.

    ``source`` says where its path came from (``GPUKIT_CLAIM_DIR``, ``claim_dir=``, ``shared``,
    ``per-user``); ``shared``: every user's claims meet here (root-owned, sticky, world-writable).
    """

    path: Path
    fd: int
    info: Folder
    source: str

    @property
    def shared(self) -> bool:
        return self.info.shared

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ClaimFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _explicit(claim_dir: str | os.PathLike[str] | None, named: str = "claim_dir=") -> tuple[Path, str, str] | None:
    """``(path, where it came from, the text as given)`` of an explicit claim folder, else ``None``."""
    if claim_dir is not None and str(claim_dir) != "":
        return Path(claim_dir), named, os.fspath(claim_dir)
    value = os.environ.get(CLAIM_DIR_ENV)
    if value:
        return Path(value), CLAIM_DIR_ENV, value
    return None


def _check_explicit(path: Path, source: str, given: str) -> None:
    shown = printable(given, max_chars=200)
    fix = ("give an absolute path to a folder every job of this machine uses, or unset it to use the machine's "
           f"shared folder ({SYSTEM_CLAIM_DIR}, made once by `{_SETUP}`)")
    if source == CLAIM_DIR_ENV:
        fix = f"set {CLAIM_DIR_ENV} to an absolute path ({fix.removeprefix('give an absolute path ')})"
    if any(not ch.isprintable() for ch in given) or len(given) > 4096:
        raise ConfigurationError(f"{source} {shown!r} is not a usable folder name; {fix}.")
    if not os.path.isabs(given):
        raise ConfigurationError(
            f"{source} {shown!r} is a relative path: each job would claim in a different folder (relative to "
            f"its working directory), so claims would not meet; {fix}.")


def _own_folder(path: str | None, private: bool) -> bool:
    """Whether ``path`` is an existing folder of this user's (``private``: closed to others too)."""
    if not path or not os.path.isabs(path):
        return False
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not (private and info.st_mode & 0o077)


def _per_user() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if _own_folder(runtime, private=True):
        return Path(runtime or "") / "gpukit-claims"
    home = os.environ.get("HOME")
    if _own_folder(home, private=False):
        host = re.sub(r"[^A-Za-z0-9._-]", "_", host_name())[:64] or "host"
        return Path(home or "") / ".cache" / "gpukit" / f"claims-{host}"
    import tempfile  # only for this fallback: it imports random, shutil and more

    return Path(tempfile.gettempdir()) / f"gpukit-claims-{os.geteuid()}"


def default_claim_dir(claim_dir: str | os.PathLike[str] | None = None) -> Path:
    """The claim folder this process uses: ``claim_dir``, else ``GPUKIT_CLAIM_DIR``, else the shared
    folder :data:`SYSTEM_CLAIM_DIR` when it exists, else this user's own folder. Creates nothing."""
    explicit = _explicit(claim_dir)
    if explicit is not None:
        return explicit[0]
    if os.path.lexists(SYSTEM_CLAIM_DIR):
        return SYSTEM_CLAIM_DIR
    return _per_user()


def _error(path: Path, source: str, problem: str, fix: str) -> DeviceError:
    where = f"the {source} claim folder {printable(str(path), max_chars=200)}" if source in ("shared", "per-user") \
        else f"{source} {printable(str(path), max_chars=200)!r}"
    return DeviceError(f"GPU claims: {where}: {problem}; {fix}.")


def _fix(source: str) -> str:
    if source == "shared":
        return f"an administrator can repair it with `{_SETUP}`"
    if source == "per-user":
        return (f"set {CLAIM_DIR_ENV} to an absolute path of a folder of your own (e.g. ~/.gpukit-claims), or ask an "
                f"administrator to run `{_SETUP}`, which makes a shared claim folder for every user")
    return f"use a folder that root or you own (`{_SETUP}` makes the machine's shared one), or unset {source}"


def open_claim_folder(claim_dir: str | os.PathLike[str] | None = None, *, create: bool = True,
                      named: str = "claim_dir=") -> ClaimFolder:
    """Open (and with ``create``, make) the claim folder and check that it can be trusted.

    ``named``: how messages call ``claim_dir`` (e.g. ``GPUKIT_CLAIM_DIR`` when it came from there).

    Raises:
        ConfigurationError: ``claim_dir`` / ``GPUKIT_CLAIM_DIR`` is relative or not a path.
        DeviceError: the folder is another user's, a symlink, not a directory, not sticky while
            others may write in it, or cannot be made; the message names the owner and the fix.
        FileNotFoundError: it does not exist and ``create`` is false.
    """
    explicit = _explicit(claim_dir, named)
    if explicit is not None:
        path, source, given = explicit
        _check_explicit(path, source, given)
    elif os.path.lexists(SYSTEM_CLAIM_DIR):
        path, source = SYSTEM_CLAIM_DIR, "shared"
    else:
        path, source = _per_user(), "per-user"
    fd = _open_or_make(path, source, create)
    info = folder_info(fd)
    if source == "per-user" and info.owner_uid == os.geteuid() and info.mode & 0o077:
        os.fchmod(fd, 0o700)  # ours: close it to others, so nothing can be planted in it
        info = folder_info(fd)
    if not info.trusted:
        os.close(fd)
        raise _error(path, source, f"not safe for claims: {info.problem}", _fix(source))
    if source == "shared" and not info.shared:
        os.close(fd)
        raise _error(path, source, f"it must be root-owned, world-writable and sticky (mode 1777), but is mode "
                     f"{info.mode & 0o7777:04o} owned by uid {info.owner_uid}", _fix(source))
    if not os.access(path, os.W_OK | os.X_OK):
        os.close(fd)
        raise _error(path, source, "not writable by this user, so no GPU can be claimed", _fix(source))
    return ClaimFolder(path, fd, info, source)


def _open_or_make(path: Path, source: str, create: bool) -> int:
    """Open the claim folder (made when missing and ``create``), reaching it from ``/`` through no
    symlink another user made (:func:`walk_folder`; run as root, through no folder another user
    controls either); the folder itself must not be a symlink."""
    make = create and source != "shared"
    root = os.geteuid() == 0
    try:
        parent = walk_folder(path.parent, make_mode=(0o700 if source == "per-user" else 0o755) if make else None,
                             strict=root or source == "per-user")
    except UnsafeEntry as exc:
        where = printable(exc.name, max_chars=200)
        if exc.kind == "a symlink" or exc.kind.startswith("a folder root cannot trust"):
            problem = f"{where} on the way is {exc.kind} of {_user(exc.owner_uid)}'s, which gpukit does not go through"
        else:
            problem = f"{where} on the way is {exc.kind} (made by {_user(exc.owner_uid)}), not a folder"
        raise _error(path, source, problem, _fix(source)) from None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _error(path, source, f"cannot open it ({exc.strerror or exc})", _fix(source)) from None
    try:
        try:
            return _open_child(parent, path, source)
        except FileNotFoundError:
            if not make:
                raise
        try:
            os.mkdir(path.name, 0o700, dir_fd=parent)
        except FileExistsError:  # made meanwhile: judged like any existing folder
            pass
        except OSError as exc:
            raise _error(path, source, f"cannot create it ({exc.strerror or exc})", _fix(source)) from None
        fd = _open_child(parent, path, source)
        if os.fstat(fd).st_uid == os.geteuid():
            # after mkdir: the umask cannot narrow a shared folder's 1777
            os.fchmod(fd, 0o1777 if root and source != "per-user" else 0o700)
        return fd
    finally:
        os.close(parent)


def _open_child(parent: int, path: Path, source: str) -> int:
    try:
        return os.open(path.name, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        info = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        raise _error(path, source, f"it is {kind_of(info.st_mode)} (made by {_user(info.st_uid)}), not a directory",
                     _fix(source)) from None


def _user(uid: int | None) -> str:
    from gpukit._util.safe_files import user_name

    return user_name(uid)


_NOTICE_GIVEN = False


def private_notice(folder: ClaimFolder | Path) -> str | None:
    """What to tell the user when claims protect only their own jobs (``None`` when shared).

    ``folder``: an open folder, or the path of one not made yet (then private unless root's shared one).
    """
    path = folder if isinstance(folder, Path) else folder.path
    shared = folder.shared if isinstance(folder, ClaimFolder) else folder == SYSTEM_CLAIM_DIR
    if shared:
        return None
    return (f"GPU claims are kept in {printable(str(path), max_chars=200)}, which only your own jobs use: "
            "they keep your jobs apart, but another user's gpukit job could take a GPU you claimed before your "
            f"job starts on it. An administrator can make a shared claim folder once: {_SETUP}")


def notice_once(folder: ClaimFolder) -> None:
    """Log :func:`private_notice` once per process (logger ``gpukit.devices``)."""
    global _NOTICE_GIVEN
    text = private_notice(folder)
    if text is None or _NOTICE_GIVEN:
        return
    _NOTICE_GIVEN = True
    from gpukit.devices._nvml import logger

    logger().warning("gpukit: %s", text)
