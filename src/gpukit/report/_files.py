"""The files of a record directory, read defensively: regular files only, bounded lines and bytes.

A record directory is untrusted input (copied from a cluster, shared, or planted): a rank file
may be a FIFO (opening it for reading would block forever), a symlink to ``/dev/zero`` (endless
data), a directory, a dangling symlink or a loop. Files are opened with ``O_NONBLOCK`` and kept
only when ``fstat`` says they are regular; lines are cut from fixed-size chunks, so a line that
never ends costs one chunk of memory, not the whole file.
"""

from __future__ import annotations

import errno
import heapq
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_LINE_BYTES", "MAX_RANK_FILES", "MAX_RECORD_BYTES", "LineReader", "RankFiles",
           "file_budget", "list_rank_files", "open_regular"]

#: A record line longer than this is skipped (the recorder's lines are well under 4 KiB).
MAX_LINE_BYTES = 64 * 1024
#: Rank files read from one record; the lowest rank numbers are kept.
MAX_RANK_FILES = 1024
#: Bytes read from one record in all (shared among its rank files); the rest is left out, with a note.
MAX_RECORD_BYTES = 512 * 2**20
_MIN_FILE_BYTES = 512 * 2**10  # every rank file gets at least this much of the budget
_CHUNK_BYTES = 1 << 20
_RANK_FILE = re.compile(r"^rank(\d{1,9})\.jsonl$")
_KIND = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symlink"}


@dataclass
class RankFiles:
    """The rank files of a directory: ``(rank, path)`` in rank order, and how many were found."""

    files: list[tuple[int, Path]]
    found: int


def list_rank_files(directory: Path, limit: int = MAX_RANK_FILES) -> RankFiles:
    """The ``rank<N>.jsonl`` entries of ``directory`` (whatever they are), the lowest ``limit`` ranks."""
    found = 0

    def entries() -> Iterator[tuple[int, str]]:
        nonlocal found
        with os.scandir(directory) as it:
            for entry in it:
                match = _RANK_FILE.match(entry.name)
                if match:
                    found += 1
                    yield int(match.group(1)), entry.name

    kept = heapq.nsmallest(limit, entries())
    return RankFiles([(rank, directory / name) for rank, name in kept], found)


def open_regular(path: Path) -> tuple[int | None, str | None]:
    """``(fd, None)`` for a regular file (symlinks followed), else ``(None, why not)``; never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symlink loop"
        if exc.errno == errno.ENOENT:
            return None, "a dangling symlink" if os.path.islink(path) else "gone"
        return None, f"cannot be opened ({exc.strerror or exc})"
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:  # pragma: no cover - fstat of an open fd does not fail in practice
        os.close(fd)
        return None, f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None, f"not a regular file ({_KIND.get(stat.S_IFMT(mode), 'a special file')})"
    return fd, None


class LineReader:
    """The lines (bytes, without the newline) of an open file, at most ``max_bytes`` of it.

    Attributes (after iterating):
        oversize: lines longer than :data:`MAX_LINE_BYTES`, skipped without being kept.
        truncated: the file had more than ``max_bytes``; the rest was not read.
        read_bytes: bytes read.
    """

    def __init__(self, fd: int, max_bytes: int, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._fd = fd
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.oversize = 0
        self.truncated = False
        self.read_bytes = 0

    def __iter__(self) -> Iterator[bytes]:
        tail = b""
        skipping = False  # inside a line already counted as oversize: drop up to its newline
        try:
            while True:
                if self.read_bytes >= self.max_bytes:
                    self.truncated = os.read(self._fd, 1) != b""
                    break
                chunk = os.read(self._fd, min(_CHUNK_BYTES, self.max_bytes - self.read_bytes))
                if not chunk:
                    break
                self.read_bytes += len(chunk)
                parts = chunk.split(b"\n")
                if skipping:  # the rest of a line already counted as oversize
                    if len(parts) == 1:
                        continue
                    skipping, parts[0] = False, b""
                first = tail + parts[0]
                if len(parts) == 1:
                    tail = first
                else:
                    tail = parts[-1]
                    parts[0] = first
                    for line in parts[:-1]:
                        if len(line) > self.max_line_bytes:
                            self.oversize += 1
                        elif line:
                            yield line
                if len(tail) > self.max_line_bytes:
                    self.oversize += 1
                    skipping, tail = True, b""
            if tail and not skipping:
                yield tail  # a last line without a newline: torn (skipped by the parser) or complete
        finally:
            os.close(self._fd)


def file_budget(files: int, total_bytes: int = MAX_RECORD_BYTES) -> int:
    """Bytes each of ``files`` rank files may read."""
    return max(_MIN_FILE_BYTES, total_bytes // max(1, files))
