"""Choosing GPUs: the "why not" report, and waiting (what qualifies and the deterministic ranking
are :mod:`gpukit.devices._criteria`'s).

A GPU never qualifies when it is unusable (e.g. "GPU is lost"), in compute mode Prohibited, in
Exclusive_Process mode with a process on it, hidden by ``CUDA_VISIBLE_DEVICES`` (when set),
excluded, claimed by another process, reserved for an older waiter of the queue
(:mod:`gpukit.devices._queue`), or -- unless ``share=True`` -- in use by another user's process
(NVML's compute processes; a process whose owner cannot be seen counts as another user's): a
claim's lock file is not the only truth, so a GPU stays busy while its job runs even if its lock
was removed. A GPU in MIG mode is offered as its MIG devices. An unknown utilization (MIG
devices report none) does not fail ``max_utilization``.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from gpukit.devices import _nvml
from gpukit.devices._criteria import (
    Criteria, check_count, check_exclude, check_order, evaluate, make_criteria, rank,
)
from gpukit.devices._snapshot import GpuSnapshot, list_gpus
from gpukit.devices._wait import poll
from gpukit.errors import ClaimTimeoutError, GpuSelectionError

__all__ = ["selection_error", "select_gpus"]


def selection_error(count: int, gpus: list[GpuSnapshot], evaluations: list[tuple[GpuSnapshot, list[str]]],
                    criteria: Criteria, *, waited_s: float | None = None) -> GpuSelectionError:
    """The error for an unmet request: one line per GPU with the criteria it failed."""
    plural = "GPU" if count == 1 else "GPUs"
    if not gpus:
        reason = _nvml.unavailable_reason() or "this machine has no NVIDIA GPU"
        return GpuSelectionError(f"Need {count} {plural} but {reason}. Run on the CPU, or on a machine with GPUs.")
    ok = sum(1 for _, why in evaluations if not why)
    if count > len(evaluations):  # no amount of waiting makes more GPUs appear
        have = len(evaluations)
        listed = "\n".join(f"  {unit.label}" for unit, _ in evaluations)
        return GpuSelectionError(
            f"Need {count} {plural}, but this machine has only {have} "
            f"GPU{'' if have == 1 else 's'}:\n{listed}\n"
            f"Ask for at most {have}, or run on a machine (or several) with more GPUs."
        )
    lines = [f"Need {count} {plural}{criteria.describe()}; {ok} of {len(evaluations)} qualify:"]
    lines += [f"  {unit.label}: {'; '.join(why) if why else 'ok'}" for unit, why in evaluations]
    if any(reason.startswith("blocked: ") for _, why in evaluations for reason in why):
        lines.append("What blocks a GPU's lock file is removed by `gpukit claims clean` (with sudo when another "
                     "user made it).")
    shareable = [unit for unit, why in evaluations if why and all(r.startswith("in use by ") for r in why)]
    if shareable:  # only other users' processes stand in the way: the one way out that needs no waiting
        lines.append(f"GPU{'s' if len(shareable) > 1 else ''} {', '.join(str(u.index) for u in shareable)} "
                     "would qualify if shared with the other users' jobs on them: add --share (share=True); the "
                     "jobs on a GPU then split its memory and compute.")
    if waited_s is not None:
        lines.append(f"Gave up after waiting {waited_s:.1f} s. Wait longer (timeout_s / --wait SECONDS), "
                     "or lower the requirements.")
        return ClaimTimeoutError("\n".join(lines))
    lines.append("Lower the requirements, exclude fewer GPUs, or wait for GPUs to free up "
                 "(wait=True, or gpukit select --wait).")
    return GpuSelectionError("\n".join(lines))


def select_gpus(
    count: int,
    *,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    order: str = "free-memory",
    share: bool = False,
    wait: bool = False,
    timeout_s: float | None = None,
    poll_interval_s: float = 1.0,
    claim_dir: str | os.PathLike[str] | None = None,
) -> list[GpuSnapshot]:
    """Choose ``count`` GPUs that meet the criteria, best first. Selecting does not claim.

    Args:
        count: how many GPUs (or MIG devices) to choose.
        min_free_memory: bytes, or a size string such as ``"8GiB"``, ``"8000MiB"``, ``"8G"``.
        max_utilization: highest GPU utilization in percent (0-100).
        max_processes: most processes already on a GPU (``0``: only idle GPUs).
        exclude: GPU indices (nvidia-smi numbering) or UUIDs / UUID prefixes to leave out.
        order: ``"free-memory"``, ``"utilization"`` or ``"index"``; ties are broken as the
            module docstring says, so the same state always gives the same choice.
        share: also choose GPUs that other users' processes are using (by default such a GPU
            is busy, whatever the claims say).
        wait: poll until enough GPUs qualify, showing on stderr what it waits for.
        timeout_s: give up waiting after this many seconds (``None``: no limit).
        poll_interval_s: seconds between polls while waiting.
        claim_dir: where claims live (see :func:`~gpukit.devices.default_claim_dir`); GPUs
            claimed by other processes, or reserved for waiters of the queue, are skipped.

    Returns:
        ``count`` snapshots, best first. Use :func:`~gpukit.devices.claim_gpus` to also hold them.

    Raises:
        GpuSelectionError: too few GPUs qualify; the message names each GPU and what it failed.
        ClaimTimeoutError: ``wait=True`` and ``timeout_s`` passed first.
        ConfigurationError: invalid arguments.
        DeviceError: the claim folder cannot be trusted (names its owner and the fix).
    """
    count = check_count(count)
    check_order(order)
    criteria = make_criteria(min_free_memory=min_free_memory, max_utilization=max_utilization,
                             max_processes=max_processes, exclude=exclude, share=share)

    def attempt() -> tuple[list[GpuSnapshot] | None, Callable[[float | None], GpuSelectionError]]:
        gpus = list_gpus()
        if not gpus:  # no driver or no GPU: waiting cannot help
            raise selection_error(count, gpus, [], criteria)
        check_exclude(gpus, criteria)
        evaluations = evaluate(gpus, criteria, _busy(gpus, claim_dir))
        if count > len(evaluations):
            raise selection_error(count, gpus, evaluations, criteria)
        chosen = rank([unit for unit, why in evaluations if not why], order)
        if len(chosen) >= count:
            return chosen[:count], lambda _w: GpuSelectionError("unreachable")
        return None, lambda waited: selection_error(count, gpus, evaluations, criteria, waited_s=waited)

    plural = "GPU" if count == 1 else "GPUs"
    return poll(attempt, wait=wait, timeout_s=timeout_s, poll_interval_s=poll_interval_s,
                what=f"{count} {plural}{criteria.describe()}")


def _busy(gpus: list[GpuSnapshot], claim_dir: str | os.PathLike[str] | None) -> dict[str, str]:
    from gpukit.devices._claim_dir import open_claim_folder
    from gpukit.devices._queue import busy_units

    try:
        folder = open_claim_folder(claim_dir, create=False)
    except FileNotFoundError:  # no claim was ever made here
        return {}
    with folder:
        return busy_units(folder, gpus)[0]
