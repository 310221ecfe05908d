"""Files in folders other users can write to: open nothing they planted, write nothing they can redirect.

The rules of DESIGN.md ("shared places are hostile"), in one place (the folders' part -- which folder to
trust, :func:`walk_folder` -- is :mod:`gpukit._util.safe_folders`, re-exported here):

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
from pathlib import Path
from typing import IO

from gpukit._util.safe_folders import (
    OPEN_FLAGS, Folder, UnsafeEntry, folder_info, kind_of, open_folder, refused_entry, user_name, walk_folder,
)

__all__ = [
    "UnsafeEntry", "Folder", "open_folder", "folder_info", "open_entry", "create_entry", "read_bounded",
    "write_note", "try_flock", "same_file", "kind_of", "user_name", "exclusive_lock", "OPEN_FLAGS", "walk_folder",
    "open_user_file", "write_user_file",
]


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
            raise refused_entry(str(target), os.stat(target.name, dir_fd=folder, follow_symlinks=False)) from None
    finally:
        os.close(folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refused_entry(str(target), info)
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
