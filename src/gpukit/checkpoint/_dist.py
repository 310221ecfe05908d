"""What the checkpoint code needs from ``torch.distributed``: rank, world size, a few collectives.

Read from ``torch.distributed`` directly (not from a Session) so plain DDP scripts get
rank-0-only writes too. Without an initialised process group this is one process, rank 0.

Checkpoint collectives run on a gloo group of their own with a short timeout
(``GPUKIT_CKPT_TIMEOUT_S``, default 300 s) instead of the training group's (30 minutes under
DDP): a rank that dies or cannot finish its part of a save makes every other rank fail within
the timeout with a :class:`~gpukit.errors.CheckpointError` naming the ranks that never
arrived (each rank marks its arrival in the job's key-value store), never wait forever.

A background save (``save(..., background=True)``) finishes in a thread of every rank while
training goes on: its collectives run on a second group, the ``"background"`` channel, with a
count of rounds of its own, so they never mix with what the training thread runs. Both groups
are created on the training thread (creating a group is itself collective, and must happen in
the same order on every rank).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from gpukit._util.envvars import CKPT_TIMEOUT_ENV
from gpukit.errors import CheckpointError
from gpukit.worker import collective_timeout_s

__all__ = ["DistContext", "current_dist", "background_dist", "TIMEOUT_ENV", "checkpoint_group", "timeout_s"]

T = TypeVar("T")
TIMEOUT_ENV = CKPT_TIMEOUT_ENV
_DEFAULT_TIMEOUT_S = 300.0
CHANNELS = ("main", "background")
_groups: dict[tuple[Any, str], Any] = {}  # (the training group, channel) -> its checkpoint group
# every rank runs the same checkpoint collectives of a channel in the same order
_rounds = {channel: itertools.count() for channel in CHANNELS}
#: A collective save waits at most this long for every rank to call it (see check_all_arrived).
ARRIVAL_TIMEOUT_MAX_S = 60.0


def timeout_s() -> float:
    """Seconds a rank waits for the others during a checkpoint (``GPUKIT_CKPT_TIMEOUT_S``)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else _DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CheckpointError(f"{TIMEOUT_ENV}={raw!r}: give the checkpoint timeout in seconds (> 0), e.g. 300.")
    return value


def checkpoint_group(channel: str = "main") -> Any:
    """The gloo group of ``channel`` with the checkpoint timeout (created on first use: call on
    every rank, from the training thread)."""
    key = (dist.group.WORLD, channel)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s()))
    return _groups[key]


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class DistContext:
    """The rank of this process, the size of its process group, and the channel its checkpoint
    collectives use (``"main"``, or ``"background"`` in a background save's thread)."""

    rank: int = 0
    world_size: int = 1
    channel: str = "main"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def run_collective(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(group)`` on every rank, failing within the timeout when a rank never arrives.

        Raises:
            CheckpointError: ``fn`` failed for want of another rank; names the missing ranks.
        """
        tag = f"gpukit/ckpt/{self.channel}/{next(_rounds[self.channel])}"
        store = _store()
        if store is not None:
            store.set(f"{tag}/{self.rank}", "arrived")
        try:
            result = fn(checkpoint_group(self.channel))
        except CheckpointError:
            raise
        except Exception as exc:
            missing = self._missing(store, tag, f"{tag}/{self.rank}/done")
            who = f"rank(s) {', '.join(map(str, missing))}" if missing else "another rank"
            raise CheckpointError(
                f"rank {self.rank}: the checkpoint's {what} failed after waiting up to "
                f"{timeout_s():g} s ({TIMEOUT_ENV}) because {who} did not take part "
                f"(killed, out of disk space, or stuck): {type(exc).__name__}: {exc}"
            ) from exc
        if store is not None:
            store.set(f"{tag}/{self.rank}/done", "1")
        return result

    def _missing(self, store: Any, tag: str, own_done: str) -> list[int]:
        if store is None:
            return []
        missing = []
        try:
            store.set(own_done, "1")
            for rank in range(self.world_size):
                try:  # a live rank that failed too marks itself done moments later
                    store.wait([f"{tag}/{rank}/done"], timedelta(seconds=2))
                except (RuntimeError, dist.DistStoreError):
                    missing.append(rank)
        except (RuntimeError, dist.DistStoreError):
            return []  # the store itself is gone (it lived in a rank that died)
        return missing

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        self.run_collective("barrier", lambda group: dist.barrier(group=group))

    def check_all_arrived(self, what: str) -> None:
        """Before a collective save: fail clearly unless every rank called ``what`` too.

        ``if rank == 0: gpukit.save(...)`` would otherwise wait in the save's first collective
        (creating the checkpoint group, then a broadcast) for a rank that never comes. Counts
        arrivals on the job's key-value store, which needs no collective.

        Raises:
            CheckpointError: not every rank arrived within min(60 s, the checkpoint timeout,
                the collective timeout ``GPUKIT_TIMEOUT_S``).
        """
        store = _store() if self.world_size > 1 else None
        if store is None:
            return
        key = f"gpukit/ckpt-arrivals/{next(_rounds[self.channel])}"
        arrived = int(store.add(key, 1))
        wait_s = min(ARRIVAL_TIMEOUT_MAX_S, timeout_s(), collective_timeout_s())
        deadline = time.monotonic() + wait_s
        while arrived < self.world_size:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{what} is collective under {self.world_size} processes (rank 0 writes, every "
                    f"rank takes part), but only {arrived} of {self.world_size} ranks called it "
                    f"within {wait_s:g} s -- was it called under `if session.is_main:` or "
                    "`if rank == 0:`? Call it on every rank (it writes from rank 0 only), or pass "
                    "rank_zero_only=False to gpukit.save to write from this rank alone."
                )
            time.sleep(0.02)
            arrived = int(store.add(key, 0))

    def broadcast_from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        self.run_collective("broadcast", lambda group: dist.broadcast_object_list(box, src=0, group=group))
        return box[0]

    def gather_all(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self.run_collective("exchange of results", lambda group: dist.all_gather_object(out, obj, group=group))
        return out


def current_dist() -> DistContext:
    """The distributed context of this process (rank 0 of 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    return DistContext()


def background_dist(context: DistContext) -> DistContext:
    """``context`` for a background save's thread; its group is created here, on the calling
    (training) thread of every rank."""
    if context.world_size > 1:
        checkpoint_group("background")
    return DistContext(rank=context.rank, world_size=context.world_size, channel="background")

