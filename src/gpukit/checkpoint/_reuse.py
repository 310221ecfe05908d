"""Files of rotated-out checkpoints kept for the next save to overwrite, instead of deleted.

Deleting a large file is not free: the file system frees every block, and where it is mounted
with online discard (ext4 ``-o discard``, common on cloud VMs and SSD hosts) the kernel sends
the discard to the disk and waits for it inside ``unlink``. Measured on this project's VM
(ext4, ``discard``, virtio disk): ``unlink`` of a 480 MiB checkpoint file took 0.62-0.72 s, in
``blkdev_issue_discard`` under ``ext4_free_blocks`` -- more than writing the file (0.2-0.5 s).
``torch.save`` over an existing file pays the same in its ``O_TRUNC``.

So rotation moves the large files of the checkpoint it removes into ``directory/.reuse/``
(a rename: no block is freed), and the next save of the same file name renames it into its
staging directory and overwrites it in place (blocks already allocated: no allocation, no
discard), cutting it to its new size at the end. Crash safety is unchanged: a reused file is
written under a temporary name, fsynced and renamed exactly like a new one, and it only ever
comes from a checkpoint that rotation had already retired (its directory renamed to debris
first, so it is never listed as complete without it).

The cost is disk space: the bin holds one set of files, at most one checkpoint's worth --
what a save needs free anyway while it writes next to the previous checkpoint.
``CheckpointManager(..., reuse_files=False)`` deletes them instead.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

__all__ = ["REUSE_DIR", "MIN_REUSE_BYTES", "retire", "take", "clear", "sole_regular_file"]

#: The bin inside a CheckpointManager's directory.
REUSE_DIR = ".reuse"
#: Smaller files are deleted: freeing them costs little.
MIN_REUSE_BYTES = 16 * 2**20
_REUSABLE = re.compile(r"^(state|rank_\d{5})\.pt$")


def retire(step_dir: Path, debris: Path, bin_dir: Path | None) -> None:
    """Remove a checkpoint directory, keeping its large files in ``bin_dir`` (``None``: delete all).

    The directory is first renamed to ``debris`` (a name the next save's clean-up knows), so a
    crash half-way never leaves a directory that looks complete but lacks a file.
    """
    try:
        os.replace(step_dir, debris)
    except OSError:
        shutil.rmtree(step_dir, ignore_errors=True)
        return
    if bin_dir is not None:
        try:
            for entry in os.scandir(debris):
                if (_REUSABLE.match(entry.name) and sole_regular_file(entry.path)
                        and entry.stat(follow_symlinks=False).st_size >= MIN_REUSE_BYTES
                        and not (bin_dir / entry.name).exists()):
                    bin_dir.mkdir(exist_ok=True)  # only when there is something to keep
                    os.rename(entry.path, bin_dir / entry.name)
        except OSError:
            pass  # reuse is an optimisation: what was not moved is deleted below
    shutil.rmtree(debris, ignore_errors=True)


def take(bin_dir: Path, name: str) -> Path | None:
    """The kept file for ``name`` if there is one (the writer renames it away: it is then its own)."""
    candidate = bin_dir / name
    return candidate if sole_regular_file(candidate) else None


def sole_regular_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (not a link to one) with no other name.

    A file with a second hard link (a backup made with ``cp -l`` or ``rsync --link-dest``, say)
    must never be overwritten in place: the other name would change with it. Such a file is
    deleted at rotation as before, and a save never adopts one.
    """
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1



def clear(bin_dir: Path) -> None:
    """Delete the bin (reuse turned off)."""
    if bin_dir.is_dir() and not bin_dir.is_symlink():
        shutil.rmtree(bin_dir, ignore_errors=True)
