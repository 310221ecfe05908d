"""Atomic file writes: a crash leaves the old file or the new one, never a torn one.

The recipe is the classic one: write a temporary file in the same directory (so the final
``os.replace`` is a rename within one file system), flush and fsync it, rename it over the
target, then fsync the directory so the rename itself survives a power cut.

Temporary files are named ``.{name}.tmp-{pid}-{hex}``: hidden, recognisable, tied to the
target name, and never mistaken for checkpoints. Leftovers of killed writers are removed by
the next write to the same target.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from gpukit._util.units import format_bytes
from gpukit.checkpoint._reuse import sole_regular_file
from gpukit.errors import CheckpointError

__all__ = [
    "atomic_write",
    "temp_path_for",
    "is_temp_name",
    "clean_temp_files",
    "fsync_directory",
    "write_error",
    "drop_cached_pages",
]

_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NO_PERMISSION = {errno.EACCES, errno.EPERM}


class _GuardedFile(io.FileIO):
    """A raw file that remembers the OS error of a failed write.

    torch's zip writer turns a failing Python ``write`` into a generic RuntimeError; keeping
    the original ``OSError`` here lets us still say "disk full" instead of "write failed".
    """

    os_error: OSError | None = None
    bytes_written: int = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        try:
            written = super().write(data) or 0
        except OSError as exc:
            self.os_error = exc
            raise
        self.bytes_written += written
        return written

    def pwrite(self, data: memoryview, offset: int) -> int:
        """``os.pwrite`` at ``offset`` (threads may call it at once; the GIL is released meanwhile)."""
        try:
            written = os.pwrite(self.fileno(), data, offset)
        except OSError as exc:
            self.os_error = exc
            raise
        self.bytes_written += written
        return written

    def pwritev(self, buffers: list[memoryview], offset: int) -> int:
        """``os.pwritev`` at ``offset`` (adjacent buffers in one call; one ``pwrite`` each where
        the OS has no ``pwritev``)."""
        try:
            if hasattr(os, "pwritev"):
                written = os.pwritev(self.fileno(), buffers, offset)
            else:
                written = os.pwrite(self.fileno(), buffers[0], offset)
        except OSError as exc:
            self.os_error = exc
            raise
        self.bytes_written += written
        return written


def drop_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the cached pages of a file about to be replaced or deleted.

    The old file stays on disk untouched (it must, until the new one is complete); only its
    page-cache copy goes, as an in-place ``O_TRUNC`` write would drop it, and the new file's
    pages reuse that memory. Measured on Linux: without this, writing a 1 GiB replacement next
    to a cached 1 GiB original took ~2x longer; on a VM whose untouched memory is slow to hand
    out, a 480 MiB checkpoint written next to the one it replaces took 2-5x longer.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open_temp_file(path: Path) -> tuple[BinaryIO, _GuardedFile]:
    """Open ``path`` for exclusive creation; returns (buffered file, raw guarded file)."""
    raw = _GuardedFile(path, "x+b")
    return io.BufferedRandom(raw, buffer_size=1024 * 1024), raw  # type: ignore[return-value]


def _open_reused_file(path: Path) -> tuple[BinaryIO, _GuardedFile]:
    """Open the existing file ``path`` (adopted for reuse) for overwriting in place."""
    raw = _GuardedFile(path, "r+b")
    return io.BufferedRandom(raw, buffer_size=1024 * 1024), raw  # type: ignore[return-value]


def temp_path_for(path: Path) -> Path:
    """The temporary sibling a write of ``path`` goes through."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of gpukit's temporary write files."""
    return _TEMP_RE.match(name) is not None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers come from failed writes that already returned
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temp_files(directory: Path, for_name: str | None = None) -> list[Path]:
    """Remove temporary files left in ``directory`` by killed writers.

    Args:
        directory: the directory to clean.
        for_name: only remove leftovers of writes to this file name; ``None`` removes all.

    Returns:
        The paths removed. Files of writers still running on this host are kept.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_RE.match(entry.name)
        if match is None or (for_name is not None and match.group("name") != for_name):
            continue
        if _pid_alive(int(match.group("pid"))):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
        except FileNotFoundError:
            pass
    return removed


def fsync_directory(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable (no-op where unsupported)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _find_os_error(exc: BaseException, raw: _GuardedFile | None) -> OSError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return raw.os_error if raw is not None else None


def write_error(exc: BaseException, path: Path, bytes_written: int | None = None) -> CheckpointError:
    """Translate a failed write of ``path`` into a CheckpointError that says what to do."""
    os_error = _find_os_error(exc, None)
    directory = path.parent
    kept = f"The previous file at {path} (if any) is unchanged." if not path.is_dir() else ""
    if os_error is not None and os_error.errno in _DISK_FULL:
        try:
            free = format_bytes(shutil.disk_usage(directory).free)
        except OSError:
            free = "unknown"
        written = f" after {format_bytes(bytes_written)}" if bytes_written else ""
        return CheckpointError(
            f"Disk full: could not write {path}{written} (no space left on the file system of "
            f"{directory}; {free} free now). {kept} Free some space or save to another directory."
        )
    if os_error is not None and os_error.errno in _NO_PERMISSION:
        return CheckpointError(
            f"Permission denied writing {path}: {os_error.strerror}. {kept} Check that this user "
            f"may create and rename files in {directory}, or save elsewhere."
        )
    if os_error is not None and os_error.errno == errno.EROFS:
        return CheckpointError(f"Cannot write {path}: {directory} is on a read-only file system.")
    if os_error is not None:
        name = errno.errorcode.get(os_error.errno or 0, "?")
        return CheckpointError(f"Could not write {path}: {os_error.strerror or os_error} ({name}). {kept}")
    return CheckpointError(f"Could not write {path}: {type(exc).__name__}: {exc}. {kept}")


def _adopt(reuse: Path | None, temp: Path) -> bool:
    """Rename the file ``reuse`` to ``temp`` (the write overwrites it in place); whether it was."""
    if reuse is None:
        return False
    try:
        os.rename(reuse, temp)  # atomic: if another writer took it first, this one fails
    except OSError:
        return False
    if not sole_regular_file(temp):  # linked meanwhile (see _reuse.py): write a new file instead
        with contextlib.suppress(OSError):
            os.unlink(temp)
        return False
    return True


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None],
                 reuse: Path | None = None) -> int:
    """Write ``path`` atomically through ``write(file)``.

    Args:
        path: the final file. Its directory is created if missing.
        write: fills the file object it is given (readable, writable and seekable). With
            ``reuse`` the file already has content: ``write`` must leave the file position at
            the end of what it wrote (the rest is cut off).
        reuse: an existing file on the same file system to overwrite instead of creating a new
            one (its blocks are reused: see ``_reuse.py``); it is renamed to the temporary
            name first, so it is this write's alone. A new file is created if it is gone.

    Returns:
        The size of the written file in bytes.

    Raises:
        CheckpointError: the write failed (disk full, no permission, ...); the previous file
            at ``path`` is untouched and the temporary file is removed.
    """
    target = Path(path)
    if target.is_dir():
        raise CheckpointError(f"Cannot save to {target}: it is a directory. Give a file path.")
    directory = target.parent
    raw: _GuardedFile | None = None
    temp: Path | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        clean_temp_files(directory, for_name=target.name)
        temp = temp_path_for(target)
        drop_cached_pages(target)
        reused = _adopt(reuse, temp)
        handle, raw = _open_reused_file(temp) if reused else _open_temp_file(temp)
        with handle:
            write(handle)
            handle.flush()
            if reused:
                handle.truncate()  # what is left of the old content past the new end
            os.fsync(handle.fileno())
            size = handle.seek(0, os.SEEK_END)
        os.replace(temp, target)
        temp = None
        fsync_directory(directory)
    except BaseException as exc:
        if temp is not None:
            try:
                os.unlink(temp)
            except OSError:
                pass
        if not isinstance(exc, Exception) or isinstance(exc, CheckpointError):
            raise  # KeyboardInterrupt & co. stay what they are
        cause = _find_os_error(exc, raw) or exc
        raise write_error(cause, target, raw.bytes_written if raw is not None else None) from exc
    return size
