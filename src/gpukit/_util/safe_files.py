"""Files in folders other users can write to: open nothing they planted, write nothing they can redirect.

The rules of DESIGN.md ("shared places are hostile"), in one place:

* every entry is opened relative to a descriptor of its folder (so a renamed or swapped path
  component cannot redirect it) with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, then checked with
  ``fstat``: only regular files are used (a symlink, FIFO, socket, device or directory is refused,
  and ``O_NONBLOCK`` means a FIFO never blocks the open);
* an existing file is opened read-only: gpukit never writes, truncates or chmods a file it did not
  create in this call; new files are created with ``O_EXCL``, and a note is written to a fresh file
  with an unpredictable name, then renamed over the old one (only its owner can do that in a
  sticky folder);
* every read is bounded;
* a folder is trusted when it is owned by root or by this user and, when others may write in it,
  sticky (like ``/tmp``): then nobody else can delete or rename what this user put there;
* a path is walked component by component from ``/`` (:func:`walk_folder`): a symlink is followed
  only when root or this user made it (the kernel's ``protected_symlinks`` rule, everywhere in
  the path, not only in sticky folders), so nobody can redirect a file gpukit writes -- or a
  folder root makes -- through a link they planted as a parent.

No torch, no gpukit imports: :mod:`gpukit.devices` (claims, the queue) and the tuning cache use it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "UnsafeEntry", "Folder", "open_folder", "folder_info", "open_entry", "create_entry", "read_bounded",
    "write_note", "try_flock", "same_file", "kind_of", "user_name", "exclusive_lock", "OPEN_FLAGS", "walk_folder",
    "open_user_file", "write_user_file",
]

OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeEntry(OSError):
    """An entry that is not a regular file (or a folder that is not a trustworthy directory)."""

    def __init__(self, name: str, kind: str, owner_uid: int | None = None) -> None:
        super().__init__(errno.EPERM, f"{name!r} is {kind}")
        self.name = name
        self.kind = kind
        self.owner_uid = owner_uid


def kind_of(mode: int) -> str:
    """``"a symlink"``, ``"a FIFO"``, ... for a ``st_mode``."""
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a special file"


def user_name(uid: int | None) -> str:
    """The account name of ``uid`` (``uid 1234`` when it has none; ``unknown user`` for ``None``)."""
    if uid is None:
        return "unknown user"
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError, OverflowError):
        return f"uid {uid}"


@dataclass(frozen=True)
class Folder:
    """What can be trusted about an open folder.

    ``trusted``: owned by root or by this user, and sticky if others may write in it.
    ``shared``: root-owned, sticky, and writable by others: every user's files meet here safely.
    ``problem``: why it is not trusted (``None`` when it is).
    """

    owner_uid: int
    mode: int
    trusted: bool
    shared: bool
    problem: str | None


def folder_info(fd: int) -> Folder:
    """Judge the folder open as ``fd`` by its owner and mode (see :class:`Folder`)."""
    info = os.fstat(fd)
    mode, owner = info.st_mode, info.st_uid
    others_write = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    sticky = bool(mode & stat.S_ISVTX)
    me = os.geteuid()
    problem = None
    if owner not in (0, me):
        problem = (f"it belongs to {user_name(owner)} (uid {owner}), not to root or to you, so that user could "
                   "delete, replace or block what you put there")
    elif others_write and not sticky:
        problem = (f"others may write in it (mode {stat.S_IMODE(mode):04o}) and it is not sticky, so any user "
                   "could delete or replace what you put there")
    shared = problem is None and owner == 0 and sticky and bool(mode & stat.S_IWOTH)
    return Folder(owner, mode, problem is None, shared, problem)


def open_folder(path: str | os.PathLike[str]) -> int:
    """A descriptor of the directory ``path`` (its last component must not be a symlink).

    Raises:
        UnsafeEntry: ``path`` is a symlink or not a directory.
        OSError: it does not exist, or cannot be opened.
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                info = os.lstat(path)
            except OSError:
                raise exc from None
            raise UnsafeEntry(str(path), kind_of(info.st_mode), info.st_uid) from None
        raise


_MAX_LINKS = 40  # as the kernel's own limit on symlinks in one path


def walk_folder(path: str | os.PathLike[str], *, make_mode: int | None = None, strict: bool = False) -> int:
    """A descriptor of the directory ``path``, reached component by component from ``/``.

    A relative ``path`` starts at the working directory. A symlink on the way is followed only
    when root or this user owns it. ``make_mode``: make
    missing folders (this user's, with that mode, whatever the umask). ``strict`` (for folders
    root makes for everyone): every folder on the way must also be owned by root or this user and
    not writable by others unless sticky, or its owner could move what is made inside it.

    Raises:
        UnsafeEntry: another user's symlink, a component that is not a directory, or (``strict``)
            another user's folder on the way; ``owner_uid`` says whose.
        OSError: a component is missing (without ``make_mode``) or cannot be opened or made.
    """
    me = os.geteuid()
    text = os.fspath(path)
    parts = [p for p in text.split("/") if p not in ("", ".")]
    # a relative path starts where the user is (the working directory is their choice)
    fd = os.open("/" if os.path.isabs(text) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    walked: list[str] = [] if os.path.isabs(text) else ["."]  # where fd is (for messages)
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = parent
                walked = walked[:-1]
                continue
            try:
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if make_mode is None:
                    raise
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: judged below like any existing entry
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode) and info.st_uid == me:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS, dir_fd=fd)
                    os.fchmod(child, make_mode)
                    os.close(child)
                    info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            shown = "/".join(["", *walked, name] if not walked or walked[0] != "." else [*walked, name])
            if stat.S_ISLNK(info.st_mode):
                if info.st_uid not in (0, me):
                    raise UnsafeEntry(shown, "a symlink", info.st_uid)
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"too many symlinks in {text}")
                target = os.readlink(name, dir_fd=fd)
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    walked = []
                continue
            if not stat.S_ISDIR(info.st_mode):
                raise UnsafeEntry(shown, kind_of(info.st_mode), info.st_uid)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
            walked.append(name)
            if strict:
                judged = folder_info(fd)
                if not judged.trusted:
                    raise UnsafeEntry(shown, f"a folder root cannot trust ({judged.problem})", judged.owner_uid)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refused(path: str, info: os.stat_result) -> UnsafeEntry:
    mine = "" if info.st_uid == os.geteuid() else f" made by {user_name(info.st_uid)}"
    return UnsafeEntry(path, f"{kind_of(info.st_mode)}{mine}, which gpukit does not write into", info.st_uid)


def _user_folder(path: Path) -> int:
    """The folder of a file gpukit writes for the user, made (0755) where missing, walked from ``/``."""
    return walk_folder(path.parent if str(path.parent) else Path("."), make_mode=0o755)


def open_user_file(path: str | os.PathLike[str], mode: str = "w", *, encoding: str = "utf-8",
                   newline: str | None = None) -> IO[str]:
    """Open a file gpukit writes for the user (a tracker's log, a run record) as text.

    Its folder is reached through no symlink another user made (:func:`walk_folder`, missing
    folders made); the file itself is opened without following a symlink and without blocking, and
    used only when it is a regular file (a FIFO, socket, device or directory is refused, never
    waited on). ``mode``: ``"w"`` (truncate), ``"w+"`` (truncate, also read) or ``"a"`` (append).

    Raises:
        UnsafeEntry: the file or a folder on the way is something gpukit does not write through;
            its ``strerror`` says what and whose.
        OSError: it cannot be made or opened.
    """
    flags = {"w": os.O_WRONLY | os.O_TRUNC, "w+": os.O_RDWR | os.O_TRUNC, "a": os.O_WRONLY | os.O_APPEND}[mode]
    target = Path(path)
    folder = _user_folder(target)
    try:
        try:  # O_TRUNC comes after the check: open without it first
            fd = os.open(target.name, (flags & ~os.O_TRUNC) | os.O_CREAT | OPEN_FLAGS, 0o644, dir_fd=folder)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            raise _refused(str(target), os.stat(target.name, dir_fd=folder, follow_symlinks=False)) from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(str(target), info)
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode, encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def write_user_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace the file ``path`` gpukit writes for the user (a configuration, a report) by ``data``,
    atomically: written to a fresh file in its folder, then renamed over the old name (which
    replaces a symlink or FIFO planted there instead of writing through it). The folder is reached
    as for :func:`open_user_file`.

    Raises:
        UnsafeEntry: a folder on the way is another user's symlink, or not a folder.
        OSError: it cannot be written (``path`` names a directory, a read-only folder...).
    """
    target = Path(path)
    folder = _user_folder(target)
    try:
        write_note(folder, target.name, data)
    finally:
        os.close(folder)


def _check_regular(fd: int, name: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeEntry(name, kind_of(info.st_mode), info.st_uid)
    return info


def open_entry(folder_fd: int, name: str) -> tuple[int, os.stat_result]:
    """Open the existing regular file ``name`` of the folder read-only (never follows, never blocks).

    Raises:
        FileNotFoundError: no such entry.
        UnsafeEntry: a symlink, FIFO, directory, ... (``owner_uid`` says who made it).
        PermissionError: not readable by this user.
    """
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            info = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            raise UnsafeEntry(name, kind_of(info.st_mode), info.st_uid) from None
        raise
    return fd, _check_regular(fd, name)


def create_entry(folder_fd: int, name: str, mode: int = 0o644) -> int:
    """Create ``name`` in the folder with exactly ``mode`` (whatever the umask), failing if anything
    by that name exists (``O_EXCL``)."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, mode, dir_fd=folder_fd)
    try:
        os.fchmod(fd, mode)  # a fresh file of ours: others must be able to read (and so lock) it
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(fd: int, limit_bytes: int) -> bytes | None:
    """Up to ``limit_bytes`` from the start of ``fd``; ``None`` when it holds more."""
    chunks: list[bytes] = []
    got = 0
    while got <= limit_bytes:
        chunk = os.pread(fd, limit_bytes + 1 - got, got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return None if got > limit_bytes else b"".join(chunks)


def write_note(folder_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``name`` by a file holding ``data``: written to a fresh ``O_EXCL`` file with an
    unpredictable name, then renamed over ``name`` (atomic; it never writes into an existing file).

    Raises:
        OSError: it could not be written or renamed (e.g. ``name`` is another user's file in a
            sticky folder); the fresh file is removed.
    """
    import secrets  # here, not at the top: hmac and hashlib cost `gpukit ls` a share of its start

    temp = f".tmp.{secrets.token_hex(16)}"
    fd = create_entry(folder_fd, temp, mode)
    try:
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(temp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=folder_fd)
        except OSError:
            pass
        raise


def try_flock(fd: int, *, exclusive: bool = True) -> bool:
    """Take ``flock`` on ``fd`` without blocking; ``False`` when another open file holds it."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def same_file(folder_fd: int, name: str, info: os.stat_result) -> bool:
    """Whether ``name`` in the folder is still the file ``info`` describes (not removed or replaced)."""
    try:
        now = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


@contextmanager
def exclusive_lock(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold ``flock`` on ``path`` (created if missing) for the ``with`` block.

    For a file in this user's own folder (a cache): opened without following a symlink, never
    truncated or chmod-ed, a lock file replaced meanwhile is opened again.

    Raises:
        TimeoutError: another process held it for ``timeout_s``.
        OSError: the folder or file cannot be opened (a symlink, a FIFO, permissions).
    """
    folder = open_folder(path.parent)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd, info = open_entry(folder, path.name)
            except FileNotFoundError:
                try:
                    fd = create_entry(folder, path.name, 0o600)
                except FileExistsError:
                    continue
                info = os.fstat(fd)
            if try_flock(fd) and same_file(folder, path.name, info):
                break
            os.close(fd)
            if time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, f"{path} is locked by another process")
            time.sleep(0.01)
        try:
            yield
        finally:
            os.close(fd)
    finally:
        os.close(folder)
