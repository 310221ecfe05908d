"""Leaving a process group cleanly at exit (its timeout: ``gpukit._util.timeouts``).

Torch 2.13's gloo backend can abort a process at interpreter exit ("terminate called
without an active exception", SIGABRT, exit 134) when the group is still alive while its
threads are torn down -- a finished run reported as failed. A strategy that created the group
registers :func:`leave_at_exit`: at exit, unless this process is failing, every rank meets at a
barrier bounded by a timeout (no rank destroys its end while a peer still uses it), then the
group is destroyed -- before the interpreter's own teardown. A process that is failing skips
the barrier (its peers are not coming) and only destroys its end.
"""

from __future__ import annotations

import atexit
import sys
from datetime import timedelta
from typing import Any

from gpukit.worker import is_failing, note_failure, note_group_to_leave

__all__ = ["EXIT_BARRIER_MAX_S", "leave_at_exit"]

#: The exit barrier waits at most this long (or the collective timeout, if shorter).
EXIT_BARRIER_MAX_S = 60.0


def _excepthook(exc_type: Any, exc: Any, tb: Any, _previous: Any = sys.excepthook) -> None:
    note_failure()
    _previous(exc_type, exc, tb)


def leave_at_exit(strategy: Any) -> None:
    """Destroy the process group ``strategy`` created at interpreter exit (see module doc)."""
    note_group_to_leave()
    if sys.excepthook is not _excepthook:
        sys.excepthook = _excepthook  # an uncaught exception: this rank is failing
    # A strong reference: every rank must come to the barrier. A weak one died with the script's
    # globals on the ranks whose Session had no reference cycle (runpy drops the script's module
    # before the exit hooks run), so the others waited out the barrier's 60 s for them and gloo
    # printed "Rank 1 failed to pass monitoredBarrier" at the end of successful runs.
    atexit.register(_leave, strategy)


def _leave(strategy: Any) -> None:
    import torch.distributed as dist

    if not getattr(strategy, "_owns_group", False) or not dist.is_initialized():
        return
    try:
        if not is_failing() and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            wait_s = min(EXIT_BARRIER_MAX_S, float(getattr(strategy, "timeout_s", None) or EXIT_BARRIER_MAX_S))
            dist.monitored_barrier(timeout=timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - a peer that left or failed: still leave our end cleanly
        pass
    try:
        strategy.teardown()
    except Exception:  # noqa: BLE001 - nothing left to report to at exit
        pass
