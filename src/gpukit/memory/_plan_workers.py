"""Plans made side by side in forked copies of this process: ``fit``'s plans on several cores.

``fit`` ranks from a few probe plans of one model (one per checkpointing policy, and one per
precision where devices exchange bytes), then plans the cheapest configurations, and with
``workers > 1`` the next ones ahead; each plan is a simulated training step that only uses one
core. :func:`plan_all` shares them out among ``workers`` processes forked from this one --
the model, the imported torch and everything the planner found of the model's structure are
there already, copy-on-write -- and this process plans its own share meanwhile. A child sends
back only the figures (JSON over a pipe: nothing is unpickled). Whatever a child could not
plan (an error, a crash, a figure that does not parse) is planned again here in the usual
order, so errors surface exactly as when planning one after another; so does everything when
forking is not safe: no ``os.fork``, or other threads running (a fork copies only the calling
thread, and a lock another thread holds would never be released in the child).

The figures are the same either way: each plan is the same function of the model and its
settings, in whichever process it runs.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict
from typing import TypeVar

from gpukit._util.cpu import MAX_AUTO_WORKERS, usable_cpu_count
from gpukit.memory._planner import MemoryEstimate

__all__ = ["available_workers", "can_fork", "plan_all"]

Key = TypeVar("Key", bound=Hashable)


def available_workers(cap: int = MAX_AUTO_WORKERS) -> int:
    """The CPUs this process may run on (its affinity), at most ``cap``."""
    return max(1, min(cap, usable_cpu_count()))


def can_fork() -> bool:
    """Whether forking copies of this process is safe here (see the module docstring)."""
    return hasattr(os, "fork") and threading.active_count() == 1


def plan_all(keys: Sequence[Key], plan: Callable[[Key], MemoryEstimate], workers: int,
             warm: bool = False) -> dict[Key, MemoryEstimate]:
    """``{key: plan(key)}`` for the ``keys`` the children planned, the rest planned here.

    ``warm``: this process has planned before, so the children may start at once; otherwise the
    first plan is made here before forking (what it loads and learns once per process -- torch's
    compiler stack, the optimizer variant that runs on fake tensors -- the children inherit).
    Exceptions of ``plan`` propagate as from a plain loop over ``keys`` in order.
    """
    keys = list(dict.fromkeys(keys))
    if workers <= 1 or len(keys) < (2 if warm else 3) or not can_fork():
        return {key: plan(key) for key in keys}
    done: dict[Key, MemoryEstimate] = {} if warm else {keys[0]: plan(keys[0])}
    rest = keys[len(done):]
    shares = min(workers, len(rest))
    groups = [rest[i::shares] for i in range(shares)]
    gc.freeze()  # the children's garbage collector leaves the inherited objects alone (no copy-on-write)
    try:
        children = [_fork(group, plan) for group in groups[1:]]
    finally:
        gc.unfreeze()
    finished = False
    try:
        for key in groups[0]:
            try:
                done[key] = plan(key)
            except Exception:  # noqa: BLE001 - planned again below, in order, where it raises
                pass
        for group, (_, read_end) in zip(groups[1:], children):
            done.update(_collect(group, read_end))
        finished = True
    finally:
        for pid, read_end in children:
            _reap(pid, read_end, kill=not finished)
    return {key: done[key] if key in done else plan(key) for key in keys}


def _fork(group: list[Key], plan: Callable[[Key], MemoryEstimate]) -> tuple[int, int]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        return pid, read_end
    # the child: plan its share, send the figures, leave without running the parent's exit handlers
    status = 1
    try:
        os.close(read_end)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the child; the parent cleans up
        figures = []
        for key in group:
            try:
                figures.append(asdict(plan(key)))
            except Exception:  # noqa: BLE001 - the parent plans it again and raises it there
                figures.append(None)
        with os.fdopen(write_end, "w", encoding="utf-8") as out:
            json.dump(figures, out)
        status = 0
    finally:
        os._exit(status)


def _collect(group: list[Key], read_end: int) -> dict[Key, MemoryEstimate]:
    """What the child reading into ``read_end`` planned of ``group`` (nothing if it failed or sent something else)."""
    with os.fdopen(read_end, "r", encoding="utf-8", closefd=False) as source:
        text = source.read()
    try:
        figures = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(figures, list) or len(figures) != len(group):
        return {}
    done = {}
    for key, entry in zip(group, figures):
        if isinstance(entry, dict):
            try:
                done[key] = MemoryEstimate(**{**entry, "notes": tuple(entry.get("notes", ()))})
            except TypeError:
                continue
    return done


def _reap(pid: int, read_end: int, kill: bool) -> None:
    """Wait for the child; end it first when the parent stops early (an interrupt, an error)."""
    try:
        os.close(read_end)
    except OSError:
        pass
    try:
        if kill:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass
