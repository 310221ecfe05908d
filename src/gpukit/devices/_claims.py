"""Claims, so two jobs never take the same "free" GPU.

A claim is an OS file lock (``filelock``: ``flock`` on Unix) on ``<claim dir>/<GPU UUID>.lock``,
taken without blocking, so of several processes racing for a GPU exactly one wins. The OS drops
the lock when its owner exits, however it exits (SIGKILL included), so a dead job never keeps a
GPU. The owner's pid is kept beside the lock (``<uuid>.owner``) for messages only; the lock is the
truth. The claim directory is ``GPUKIT_CLAIM_DIR`` or ``<temp dir>/gpukit-claims``; every user
of a machine must share it for claims to see each other (the default does). The files themselves
are :mod:`gpukit.devices._claim_files`; choosing which GPUs qualify is :mod:`gpukit.devices._select`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from gpukit.devices._claim_files import (
    CLAIM_DIR_ENV,
    _ensure_dir,
    _read_owner,
    _stem,
    _try_acquire,
    _write_owner,
    claim_holders,
    claim_owners,
    default_claim_dir,
)
from gpukit.devices._select import (
    check_count, check_exclude, check_order, claimed_reason, evaluate, make_criteria, poll, selection_error,
)
from gpukit.devices._select import rank as rank_gpus
from gpukit.devices._snapshot import GpuSnapshot, list_gpus, selectable_units
from gpukit.errors import ConfigurationError, DeviceError, GpuSelectionError

__all__ = ["CLAIM_DIR_ENV", "GpuClaim", "claim_gpus", "claim_holders", "claim_owners", "default_claim_dir"]


# Claims alive in this process. A FileLock releases itself when garbage-collected, so without this
# `gpus = claim_gpus(2).gpus` would drop the claim at once; the contract is "until release or exit".
_LIVE: set[GpuClaim] = set()


class GpuClaim:
    """GPUs this process holds. Release with :meth:`release`, a ``with`` block, or by exiting.

    The claim stays held even when the object is no longer referenced.

    Attributes:
        gpus: the claimed GPUs (or MIG devices), best first.
        claim_dir: the directory holding the locks.
    """

    def __init__(self, gpus: list[GpuSnapshot], locks: list[Any], claim_dir: Path) -> None:
        self.gpus = gpus
        self.claim_dir = claim_dir
        self._locks = locks
        if locks:
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
        for gpu, lock in zip(self.gpus, locks, strict=True):
            # The owner note goes first: once unlocked, the next owner writes its own.
            try:
                (self.claim_dir / f"{_stem(gpu.uuid or '')}.owner").unlink()
            except OSError:
                pass
            lock.release(force=True)

    def label(self, run: str, ranks: Sequence[int | None]) -> None:
        """Note which run and rank use each claimed GPU (``gpukit ls`` shows them).

        Args:
            run: the run's id (``GPUKIT_RUN_ID``).
            ranks: the rank using each GPU of :attr:`gpus`, in order (``None``: not one rank).
        """
        for gpu, rank in zip(self.gpus, ranks):
            if gpu.uuid is not None and not self.released:
                _write_owner(self.claim_dir, gpu.uuid, run=run, **({} if rank is None else {"rank": rank}))

    def __enter__(self) -> GpuClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"GpuClaim([{', '.join(g.label for g in self.gpus)}], {state})"


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
    wait: bool = False,
    timeout_s: float | None = None,
    poll_interval_s: float = 1.0,
    claim_dir: str | os.PathLike[str] | None = None,
) -> GpuClaim:
    """Select and claim GPUs, so that no other gpukit job takes them until released.

    Selection is as in :func:`~gpukit.devices.select_gpus`; then each chosen GPU is locked
    without blocking, best first, skipping GPUs another process wins, so concurrent claimers
    never share a GPU. The claim lasts until :meth:`GpuClaim.release`, the end of a ``with``
    block, or the exit of this process (the OS releases the locks even on SIGKILL).

    Args:
        count: how many GPUs; may be left out when ``gpus`` is given.
        gpus: claim exactly these (indices, UUIDs / prefixes, or snapshots) instead of selecting.
        wait: keep polling until enough GPUs qualify and are unclaimed, showing on stderr what
            it waits for. While waiting nothing is held, so waiters cannot deadlock.
        timeout_s: give up waiting after this many seconds (``None``: no limit).
        claim_dir: default ``GPUKIT_CLAIM_DIR``, else ``<temp dir>/gpukit-claims``.
        min_free_memory, max_utilization, max_processes, exclude, order, poll_interval_s:
            as for :func:`~gpukit.devices.select_gpus`.

    Returns:
        A :class:`GpuClaim` (a context manager) whose ``.gpus`` are the claimed snapshots.

    Raises:
        GpuSelectionError: too few GPUs qualify or are free; names each GPU and why.
        ClaimTimeoutError: ``wait=True`` and ``timeout_s`` passed first.
        DeviceError: a GPU in ``gpus`` does not exist.
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
                             max_processes=max_processes, exclude=exclude)
    directory = _ensure_dir(default_claim_dir(claim_dir))
    wanted = gpus

    def attempt() -> tuple[GpuClaim | None, Callable[[float | None], GpuSelectionError]]:
        snapshot = list_gpus()
        if not snapshot:
            raise selection_error(count, snapshot, [], criteria)
        check_exclude(snapshot, criteria)
        if wanted is not None:
            candidates = _resolve_targets(wanted, snapshot)
            evaluations: list[tuple[GpuSnapshot, list[str]]] = [(u, []) for u in candidates]
        else:
            evaluations = evaluate(snapshot, criteria)
            if count > len(evaluations):
                raise selection_error(count, snapshot, evaluations, criteria)
            candidates = rank_gpus([u for u, why in evaluations if not why], order)
        held: list[tuple[GpuSnapshot, Any]] = []
        lost: dict[str, int | None] = {}
        for unit in candidates:
            lock = _try_acquire(directory, unit.uuid or "") if unit.uuid else None
            if lock is None:
                lost[unit.uuid or ""] = _read_owner(directory, unit.uuid or "")
                if wanted is not None:
                    break  # all or nothing
                continue
            held.append((unit, lock))
            if len(held) == count:
                return GpuClaim([u for u, _ in held], [lk for _, lk in held], directory), _unreachable
        GpuClaim([u for u, _ in held], [lk for _, lk in held], directory).release()  # all or nothing
        report = _with_claims(evaluations, lost)
        return None, lambda waited: selection_error(count, snapshot, report, criteria, waited_s=waited)

    plural = "GPU" if count == 1 else "GPUs"
    return poll(attempt, wait=wait, timeout_s=timeout_s, poll_interval_s=poll_interval_s,
                what=f"{count} {plural}{criteria.describe()}")


def _unreachable(_waited: float | None) -> GpuSelectionError:  # pragma: no cover - success path
    return GpuSelectionError("internal: no error")


def _with_claims(evaluations: list[tuple[GpuSnapshot, list[str]]],
                 lost: Mapping[str, int | None]) -> list[tuple[GpuSnapshot, list[str]]]:
    out = []
    for unit, why in evaluations:
        why = list(why)
        if unit.uuid is not None and unit.uuid in lost:
            why.append(claimed_reason(lost[unit.uuid]))
        out.append((unit, why))
    return out
