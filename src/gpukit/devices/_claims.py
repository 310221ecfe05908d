"""Claims, so two jobs never take the same "free" GPU.

A claim is ``flock`` on ``<claim folder>/<GPU UUID>.lock``, taken without blocking, so of several
processes racing for a GPU exactly one wins. The OS drops the lock when its owner exits, however
it exits (SIGKILL included), so a dead job never keeps a GPU. The kernel knows who holds it; the
holder's note (``<uuid>.<pid>.owner``) adds the run and rank for messages. Where claims live and
when a folder is trusted: :mod:`gpukit.devices._claim_dir`; the files: :mod:`._claim_files`;
waiting in turn: :mod:`._queue`; which GPUs qualify: :mod:`._select`.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Sequence

from gpukit.devices._claim_dir import CLAIM_DIR_ENV, ClaimFolder, default_claim_dir, notice_once, open_claim_folder
from gpukit.devices._claim_files import acquire, claim_holders, claim_owners, remove_owner, write_owner
from gpukit.devices._criteria import (
    Criteria, allowed_units, check_count, check_exclude, check_order, evaluate, make_criteria,
)
from gpukit.devices._criteria import rank as rank_gpus
from gpukit.devices._select import selection_error
from gpukit.devices._snapshot import GpuSnapshot, list_gpus, selectable_units
from gpukit.devices._wait import poll
from gpukit.errors import ConfigurationError, DeviceError, GpuSelectionError

__all__ = ["CLAIM_DIR_ENV", "GpuClaim", "claim_gpus", "claim_holders", "claim_owners", "default_claim_dir"]


# Claims alive in this process: the contract is "until release or exit", whether or not the
# GpuClaim object is still referenced.
_LIVE: set[GpuClaim] = set()
_AT_EXIT = False


class GpuClaim:
    """GPUs this process holds. Release with :meth:`release`, a ``with`` block, or by exiting.

    The claim stays held even when the object is no longer referenced.

    Attributes:
        gpus: the claimed GPUs (or MIG devices), best first.
        claim_dir: the folder holding the locks.
    """

    def __init__(self, gpus: list[GpuSnapshot], locks: list[int], folder: ClaimFolder) -> None:
        self.gpus = gpus
        self.claim_dir = folder.path
        self._folder = folder
        self._locks = locks
        if locks:
            global _AT_EXIT
            if not _AT_EXIT:
                import atexit

                atexit.register(_release_all)  # the notes go with the process (the kernel drops the locks)
                _AT_EXIT = True
            _LIVE.add(self)

    @property
    def released(self) -> bool:
        return not self._locks

    @property
    def visible_devices(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value for these GPUs (indices; MIG devices by ``MIG-`` id)."""
        return ",".join(g.uuid or "" if g.is_mig else str(g.index) for g in self.gpus)

    def release(self) -> None:
        """Give the GPUs back. Safe to call twice."""
        locks, self._locks = self._locks, []
        _LIVE.discard(self)
        if not locks:
            return
        for gpu, fd in zip(self.gpus, locks, strict=True):
            remove_owner(self._folder, gpu.uuid or "")  # first: once unlocked, the next owner writes its own
            os.close(fd)
        self._folder.close()

    def label(self, run: str, ranks: Sequence[int | None]) -> None:
        """Note which run and rank use each claimed GPU (``gpukit ls`` shows them).

        Args:
            run: the run's id (``GPUKIT_RUN_ID``).
            ranks: the rank using each GPU of :attr:`gpus`, in order (``None``: not one rank).
        """
        for gpu, rank in zip(self.gpus, ranks):
            if gpu.uuid is not None and not self.released:
                write_owner(self._folder, gpu.uuid, run=run, **({} if rank is None else {"rank": rank}))

    def __enter__(self) -> GpuClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"GpuClaim([{', '.join(g.label for g in self.gpus)}], {state})"


def _release_all() -> None:
    for claim in list(_LIVE):
        claim.release()


def _resolve_targets(targets: Sequence[int | str | GpuSnapshot], gpus: list[GpuSnapshot]) -> list[GpuSnapshot]:
    units = selectable_units(gpus)
    out: list[GpuSnapshot] = []
    for target in targets:
        if isinstance(target, GpuSnapshot):
            target = target.uuid or target.index
        if isinstance(target, str) and target.strip().isdigit():
            target = int(target)
        if isinstance(target, int) and not isinstance(target, bool):
            hits = [u for u in units if u.index == target]
        elif isinstance(target, str):
            hits = [u for u in units if (u.uuid or "").lower().startswith(target.lower())]
        else:
            raise ConfigurationError(f"Cannot claim {target!r}: give GPU indices, UUIDs or snapshots.")
        if len(hits) != 1:
            known = ", ".join(f"{u.label} {u.uuid}" for u in units) or "none"
            problem = "matches several devices" if hits else "is not a GPU on this machine"
            raise DeviceError(f"Cannot claim {target!r}: it {problem}. GPUs here: {known}.")
        if hits[0] in out:
            raise ConfigurationError(f"GPU {target!r} is listed twice in gpus=.")
        out.append(hits[0])
    return out


def claim_gpus(
    count: int | None = None,
    *,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    gpus: Sequence[int | str | GpuSnapshot] | None = None,
    order: str = "free-memory",
    share: bool = False,
    wait: bool = False,
    timeout_s: float | None = None,
    poll_interval_s: float = 1.0,
    claim_dir: str | os.PathLike[str] | None = None,
    run: str | None = None,
) -> GpuClaim:
    """Select and claim GPUs, so that no other gpukit job takes them until released.

    Selection is as in :func:`~gpukit.devices.select_gpus`; then each chosen GPU is locked
    without blocking, best first, skipping GPUs another process wins, so concurrent claimers
    never share a GPU. The claim lasts until :meth:`GpuClaim.release`, the end of a ``with``
    block, or the exit of this process (the OS releases the locks even on SIGKILL).

    Args:
        count: how many GPUs; may be left out when ``gpus`` is given.
        gpus: claim exactly these (indices, UUIDs / prefixes, or snapshots) instead of selecting.
        share: also take GPUs other users' processes are using (by default they are busy).
        wait: wait in the fair queue until enough GPUs qualify and are free, showing on stderr
            what it waits for. While waiting no GPU is held (so waiters cannot deadlock), and a
            GPU that frees up goes to the oldest waiter it helps (:mod:`gpukit.devices._queue`).
            Without ``wait``, GPUs reserved for waiters are not taken either; when only a waiter
            that could take its GPUs now holds them back, the claim watches it for at most the
            queue's stall bound (10-30 s) and then passes it over.
        timeout_s: give up waiting after this many seconds (``None``: no limit).
        claim_dir: see :func:`~gpukit.devices.default_claim_dir`.
        run: a run id to show in the queue while waiting (``gpukit run`` passes its own).
        min_free_memory, max_utilization, max_processes, exclude, order, poll_interval_s:
            as for :func:`~gpukit.devices.select_gpus`.

    Returns:
        A :class:`GpuClaim` (a context manager) whose ``.gpus`` are the claimed snapshots.

    Raises:
        GpuSelectionError: too few GPUs qualify or are free; names each GPU and why.
        ClaimTimeoutError: ``wait=True`` and ``timeout_s`` passed first.
        DeviceError: a GPU in ``gpus`` does not exist, or the claim folder cannot be trusted.
        ConfigurationError: invalid arguments.
    """
    check_order(order)
    if gpus is not None:
        if isinstance(gpus, (str, int)):
            gpus = [gpus]
        if count is not None and count != len(gpus):
            raise ConfigurationError(f"count={count} but gpus= lists {len(gpus)}; leave count out with gpus=.")
        count = check_count(len(gpus))
    else:
        count = check_count(count)
    criteria = make_criteria(min_free_memory=min_free_memory, max_utilization=max_utilization,
                             max_processes=max_processes, exclude=exclude, share=share)
    folder = open_claim_folder(claim_dir)
    try:
        notice_once(folder)
        return _claim(folder, count, criteria, gpus, order, wait, timeout_s, poll_interval_s, run)
    except BaseException:
        folder.close()
        raise


def _claim(folder: ClaimFolder, count: int, criteria: Criteria, wanted: Sequence[int | str | GpuSnapshot] | None,
           order: str, wait: bool, timeout_s: float | None, poll_interval_s: float, run: str | None) -> GpuClaim:
    from gpukit.devices._queue import STALL_MAX_S, STALL_MIN_S, Ticket, busy_units, request_of, waiter_interval_s

    ticket: Ticket | None = None
    stalls: dict[str, float] = {}
    ahead = 0  # live waiters older than this one
    watching = False  # a claim that does not wait, held up only by a ticket that may be stalled
    watch_deadline = time.monotonic() + max(STALL_MIN_S, STALL_MAX_S) + 1.0

    def attempt() -> tuple[GpuClaim | None, Callable[[float | None], GpuSelectionError]]:
        nonlocal ticket, ahead, watching
        snapshot = list_gpus()
        if not snapshot:
            raise selection_error(count, snapshot, [], criteria)
        check_exclude(snapshot, criteria)
        targets = None if wanted is None else _resolve_targets(wanted, snapshot)
        if targets is None and count > len(selectable_units(snapshot)):
            raise selection_error(count, snapshot, evaluate(snapshot, criteria), criteria)
        if wait and ticket is None:  # in the queue from the first look on
            within = allowed_units(snapshot, criteria) if targets is None else {u.uuid or "" for u in targets}
            ticket = Ticket(folder, request_of(count, within, criteria, order, poll_interval_s, run))
        busy, ahead, reserved = busy_units(folder, snapshot, ticket, stalls)
        evaluations = evaluate(snapshot, criteria, busy)
        if targets is not None:
            evaluations = [(u, why) for u, why in evaluations if u in targets]
            evaluations.sort(key=lambda item: targets.index(item[0]))
            candidates = [u for u, why in evaluations if not why]
            if len(candidates) < count:
                candidates = []  # all or nothing
        else:
            candidates = rank_gpus([u for u, why in evaluations if not why], order)
        held: list[tuple[GpuSnapshot, int]] = []
        for unit in candidates[: count if targets is not None else None]:
            fd = acquire(folder, unit.uuid) if unit.uuid else None
            if fd is None:
                if targets is not None:
                    break  # all or nothing
                continue
            write_owner(folder, unit.uuid or "", **({} if run is None else {"run": run}))
            held.append((unit, fd))
            if len(held) == count:
                return GpuClaim([u for u, _ in held], [fd for _, fd in held], folder), _unreachable
        for unit, fd in held:  # all or nothing
            remove_owner(folder, unit.uuid or "")
            os.close(fd)
        if not wait:  # held up only by GPUs a ticket reserves that it could take now: watch it, boundedly
            unreserved = {uuid: why for uuid, why in busy.items() if uuid not in reserved}
            enough = sum(1 for u, why in evaluate(snapshot, criteria, unreserved) if not why
                         and (targets is None or u in targets)) >= count
            watching = enough and bool(stalls) and time.monotonic() < watch_deadline
        return None, lambda waited: selection_error(count, snapshot, evaluations, criteria, waited_s=waited)

    plural = "GPU" if count == 1 else "GPUs"
    try:
        # far back in the queue, GPUs come later: look less often (at most 5x), so that many
        # waiters do not keep the machine busy; the first few look every poll_interval_s
        return poll(attempt, wait=lambda: wait or watching, timeout_s=timeout_s, poll_interval_s=poll_interval_s,
                    what=f"{count} {plural}{criteria.describe()}",
                    interval=lambda: min(poll_interval_s, 0.2) if watching else waiter_interval_s(poll_interval_s, ahead))
    finally:
        if ticket is not None:
            ticket.close()


def _unreachable(_waited: float | None) -> GpuSelectionError:  # pragma: no cover - success path
    return GpuSelectionError("internal: no error")
