"""A warning that every rank gives is printed once, not once per rank.

Under ``gpukit run`` every worker writes to the same terminal, so a warning that each rank raises
alike (a library's deprecation, gpukit's own advice) appeared ``nproc`` times. Here the worker's
``warnings.showwarning`` first claims the warning in the run's directory: a file named after the
warning's text and its occurrence in this process (the 1st, 2nd... time this process shows that
text), created with ``O_EXCL``. The rank that creates it prints; the others skip. A warning whose
text differs per rank (it names the rank) is printed by each, and a process that shows the same
text again prints it again (its next occurrence is a new name). When the claim cannot be made (no
run directory, a file system error), the warning is printed as before.
"""

from __future__ import annotations

import collections
import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["WARNED_PREFIX", "show_warnings_once_per_run"]

#: file names of the claims in the run's directory
WARNED_PREFIX = "warned-"


def show_warnings_once_per_run(run_dir: str | os.PathLike[str] | None) -> None:
    """Make ``warnings.showwarning`` print a warning once across the run's ranks (see the module docstring)."""
    if not run_dir:
        return
    directory = Path(run_dir)
    shown = warnings.showwarning
    seen: collections.Counter[str] = collections.Counter()

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line)
        seen[text] += 1
        key = hashlib.blake2b(f"{seen[text]}\0{text}".encode(), digest_size=12).hexdigest()
        try:
            fd = os.open(directory / f"{WARNED_PREFIX}{key}",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except FileExistsError:
            return  # another rank printed this one
        except OSError:
            pass  # no claim possible: print, as without this hook
        else:
            os.close(fd)
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
