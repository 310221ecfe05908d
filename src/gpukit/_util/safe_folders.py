"""Folders in places other users can write to: which to trust, and reaching one through no symlink
another user made (:func:`walk_folder`). The rules are :mod:`gpukit._util.safe_files`'s docstring; the
files inside such folders are opened there. No torch, no gpukit imports.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

__all__ = ["Folder", "OPEN_FLAGS", "UnsafeEntry", "folder_info", "kind_of", "open_folder", "refused_entry",
           "user_name", "walk_folder"]

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


def refused_entry(path: str, info: os.stat_result) -> UnsafeEntry:
    """The error for ``path``, an entry gpukit will not write into (``info`` says what it is, whose)."""
    mine = "" if info.st_uid == os.geteuid() else f" made by {user_name(info.st_uid)}"
    return UnsafeEntry(path, f"{kind_of(info.st_mode)}{mine}, which gpukit does not write into", info.st_uid)

