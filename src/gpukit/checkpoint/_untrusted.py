"""Reading files from a checkpoint directory, which anyone may have planted.

Every reader goes through :func:`regular_file_size` (or :func:`read_bytes` / :func:`read_json`)
before it opens a file for its content:

- only regular files are read: a FIFO would block ``open()`` forever, ``/dev/zero`` never ends,
  a directory or a dangling symlink or a symlink loop is no checkpoint; each gets a
  :class:`~gpukit.errors.CheckpointError` naming the path and what it is;
- files are opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a
  FIFO swapped in after a ``stat`` still cannot block;
- sizes are bounded before anything is read or allocated, and JSON nesting is bounded.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from gpukit.errors import CheckpointError

__all__ = ["regular_file_size", "read_bytes", "read_json", "is_plain_name", "check_output", "MAX_JSON_BYTES"]

#: complete.json and similar records: a step with a million files stays far below this
MAX_JSON_BYTES = 16 * 2**20
_MAX_JSON_DEPTH = 32


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _os_error(path: Path, what: str, exc: OSError) -> CheckpointError:
    if exc.errno == errno.ENOENT:
        dangling = os.path.islink(path)
        why = "a symlink to a missing file" if dangling else "missing"
        return CheckpointError(f"{what} {path} is {why}.")
    if exc.errno == errno.ELOOP:
        return CheckpointError(f"{what} {path} is a symlink loop (it never reaches a file).")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return CheckpointError(f"Permission denied reading {what} {path}: check the file's owner and mode.")
    return CheckpointError(f"Cannot read {what} {path}: {exc.strerror or exc}.")


def _not_regular(path: Path, what: str, mode: int) -> CheckpointError:
    return CheckpointError(f"{what} {path} is {_kind(mode)}, not a regular file: checkpoints are read "
                           "from regular files only. Replace it with the real file, or use another checkpoint.")


def regular_file_size(path: Path, what: str = "checkpoint file", limit_bytes: int | None = None) -> int:
    """The size of ``path`` after checking, on an open descriptor, that it is a regular file.

    Args:
        path: the file (symlinks are followed; loops and dangling links are errors).
        what: how messages name it ("shard index", "complete.json", ...).
        limit_bytes: refuse larger files.

    Raises:
        CheckpointError: missing, not a regular file, unreadable, or over ``limit_bytes``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        try:  # a FIFO without writers opens fine with O_NONBLOCK; other special files may not
            mode = os.stat(path).st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise _not_regular(path, what, mode) from None
        raise _os_error(path, what, exc) from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, what, info.st_mode)
    if limit_bytes is not None and info.st_size > limit_bytes:
        raise CheckpointError(f"{what} {path} has {info.st_size:,} bytes, more than the {limit_bytes:,} such a "
                              "file can have: it is not what it claims to be. Use another checkpoint.")
    return info.st_size


def read_bytes(path: Path, limit_bytes: int, what: str = "checkpoint file") -> bytes:
    """The content of the regular file ``path``, refused when over ``limit_bytes``."""
    regular_file_size(path, what, limit_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):  # swapped since the check
                raise CheckpointError(f"{what} {path} changed into a special file while being read.")
            data = handle.read(limit_bytes + 1)
    except OSError as exc:
        raise _os_error(path, what, exc) from None
    if len(data) > limit_bytes:
        raise CheckpointError(f"{what} {path} grew past {limit_bytes:,} bytes while being read.")
    return data


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON, without recursion (stops counting past ``limit``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def read_json(path: Path, what: str, limit_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """A JSON object from the regular file ``path`` (size and nesting bounded).

    Raises:
        CheckpointError: not a regular file, too large, not JSON, too deeply nested, not an object.
    """
    raw = read_bytes(path, limit_bytes, what)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{what} {path} is nested too deeply to be a gpukit record.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} {path} is not valid JSON ({str(exc)[:120]}).") from None
    if _depth(value, _MAX_JSON_DEPTH) > _MAX_JSON_DEPTH:
        raise CheckpointError(f"{what} {path} is nested more than {_MAX_JSON_DEPTH} levels deep: not a gpukit record.")
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} holds a JSON {type(value).__name__}, not an object.")
    return value


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside its directory (no path separators, not ``.``/``..``)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def check_output(path: Path) -> None:
    """Refuse to write a checkpoint over anything but a regular file (or into a directory).

    A file is written to a temporary name and renamed over ``path``: over ``/dev/null`` (as
    root) that would replace the device node with a regular file.

    Raises:
        CheckpointError: ``path`` (or what its symlink names) is a device, FIFO or socket.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing (or a dangling symlink): a new file is made
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise CheckpointError(f"Refused to write {path}: it is {_kind(mode)}, and writing replaces the file at that "
                              "path (a temporary file renamed over it). Give the path of a regular file to write.")
