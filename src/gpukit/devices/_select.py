"""Choosing GPUs: criteria, the deterministic ranking, the "why not" report, and waiting.

Ranking (``order``), best first, ties broken left to right:

* ``"free-memory"`` (default): most free memory, then lower GPU utilization (unknown counts as
  busiest), then fewer processes, then lower NVML index (then MIG instance id).
* ``"utilization"``: lower GPU utilization, then most free memory, fewer processes, lower index.
* ``"index"``: NVML index order (``nvidia-smi`` order), MIG devices by instance id.

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

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from gpukit._util.safe_files import user_name
from gpukit._util.text import printable
from gpukit._util.units import format_bytes, parse_size
from gpukit.devices import _nvml
from gpukit.devices._snapshot import GpuSnapshot, list_gpus, selectable_units
from gpukit.devices._visible import ENV_VAR, resolve_visible
from gpukit.devices._wait import poll
from gpukit.errors import ClaimTimeoutError, ConfigurationError, GpuSelectionError

__all__ = ["ORDERS", "Criteria", "make_criteria", "evaluate", "failures", "rank", "selection_error", "select_gpus",
           "current_user"]

ORDERS = ("free-memory", "utilization", "index")


@dataclass(frozen=True)
class Criteria:
    """Validated selection criteria (sizes in bytes)."""

    min_free_memory_bytes: int | None = None
    max_utilization_pct: float | None = None
    max_processes: int | None = None
    exclude: tuple[int | str, ...] = ()
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES when set: only those GPUs qualify
    share: bool = False  # also take GPUs that other users' processes use

    def describe(self) -> str:
        parts = []
        if self.min_free_memory_bytes is not None:
            parts.append(f"free memory >= {format_bytes(self.min_free_memory_bytes)}")
        if self.max_utilization_pct is not None:
            parts.append(f"utilization <= {self.max_utilization_pct:g}%")
        if self.max_processes is not None:
            parts.append(f"at most {self.max_processes} process(es)")
        return " with " + ", ".join(parts) if parts else ""


def make_criteria(
    *,
    min_free_memory: int | str | None = None,
    max_utilization: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    share: bool = False,
    env: Mapping[str, str] | None = None,
) -> Criteria:
    """Validate user-given criteria.

    Raises:
        ConfigurationError: a size not in an accepted form, a percentage outside 0-100, a
            negative process count, or an exclude entry that is neither an index nor a UUID.
    """
    min_free = None if min_free_memory is None else parse_size(min_free_memory)
    if max_utilization is not None:
        if isinstance(max_utilization, bool) or not isinstance(max_utilization, (int, float)) \
                or not 0 <= max_utilization <= 100:
            raise ConfigurationError(f"max_utilization={max_utilization!r}: give a percentage between 0 and 100.")
    if max_processes is not None and (isinstance(max_processes, bool) or not isinstance(max_processes, int)
                                      or max_processes < 0):
        raise ConfigurationError(f"max_processes={max_processes!r}: give a whole number >= 0.")
    if isinstance(exclude, (str, int)):
        exclude = [exclude]
    excluded: list[int | str] = []
    for item in exclude:
        if isinstance(item, str) and re.fullmatch(r"[0-9]{1,9}", item.strip()):  # ASCII: '²'.isdigit() too
            item = int(item.strip())
        if isinstance(item, bool) or not (isinstance(item, int) and item >= 0
                                          or isinstance(item, str) and item.startswith(("GPU-", "MIG-"))):
            shown = item if not isinstance(item, str) or len(item) <= 60 else item[:60] + "..."
            raise ConfigurationError(
                f"Cannot exclude {shown!r}: give a GPU index as nvidia-smi shows it (0, 1, ...) "
                f"or a UUID or UUID prefix starting with 'GPU-' or 'MIG-'.")
        excluded.append(item)
    if not isinstance(share, bool):
        raise ConfigurationError(f"share={share!r}: give True (also take GPUs other users' processes use) or False.")
    env = os.environ if env is None else env
    return Criteria(min_free, None if max_utilization is None else float(max_utilization), max_processes,
                    tuple(excluded), env.get(ENV_VAR), share)


def _is_excluded(unit: GpuSnapshot, exclude: tuple[int | str, ...]) -> bool:
    for item in exclude:
        if isinstance(item, int) and unit.index == item:
            return True
        if isinstance(item, str) and any((u or "").lower().startswith(item.lower())
                                         for u in (unit.uuid, unit.mig_parent_uuid)):
            return True
    return False


def check_exclude(gpus: list[GpuSnapshot], criteria: Criteria) -> None:
    """Refuse exclude entries that name no GPU here: a typo would otherwise exclude nothing.

    Raises:
        ConfigurationError: naming the entries and listing the GPUs that exist.
    """
    units = selectable_units(gpus)
    unknown = [item for item in criteria.exclude
               if not any(_is_excluded(unit, (item,)) for unit in [*gpus, *units])]
    if not unknown:
        return
    shown = ", ".join(map(repr, unknown))
    listed = "\n".join(f"  {unit.label}" for unit in units)
    raise ConfigurationError(
        f"Cannot exclude {shown}: no GPU here has that index or UUID. The GPUs on this machine "
        f"are:\n{listed}\nExclude only GPUs from this list (indices as `gpukit ls` and "
        "nvidia-smi show them)."
    )


def current_user() -> str:
    """This process's account name (how NVML's process list names users)."""
    return user_name(os.geteuid())


def _others(unit: GpuSnapshot, me: str) -> str | None:
    """Why another user's process makes ``unit`` busy (``None``: only this user's, or none)."""
    foreign = [p for p in unit.processes if p.user != me]
    if not foreign:
        return None
    first = foreign[0]
    who = f"{printable(first.user, max_chars=32)}'s" if first.user else "an unknown user's"
    command = f" ({printable(first.command, max_chars=40)})" if first.command else ""
    more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
    return f"in use by {who} pid {first.pid}{command}{more}"


def failures(unit: GpuSnapshot, criteria: Criteria, user: str) -> list[str]:
    """Why ``unit`` fails ``criteria`` for a job of ``user`` (claims and the queue aside)."""
    if not unit.usable:
        return [f"unusable: {unit.error or 'unknown error'}"]
    why: list[str] = []
    if unit.compute_mode == "Prohibited":
        why.append("compute mode Prohibited (no CUDA work allowed)")
    elif unit.compute_mode == "Exclusive_Process" and unit.processes:
        why.append(f"Exclusive_Process mode and in use by pid {unit.processes[0].pid}")
    free = unit.memory_free_bytes
    need = criteria.min_free_memory_bytes
    if need is not None and (free is None or free < need):
        why.append(f"free {format_bytes(free)} < required {format_bytes(need)}")
    util = unit.utilization_gpu_pct
    if criteria.max_utilization_pct is not None and util is not None and util > criteria.max_utilization_pct:
        why.append(f"utilization {util}% > max {criteria.max_utilization_pct:g}%")
    if criteria.max_processes is not None and len(unit.processes) > criteria.max_processes:
        why.append(f"{len(unit.processes)} process(es) > max {criteria.max_processes}")
    if not criteria.share:
        other = _others(unit, user)
        if other is not None:
            why.append(other)
    return why


def allowed_units(gpus: list[GpuSnapshot], criteria: Criteria) -> set[str]:
    """UUIDs of the units neither hidden by ``CUDA_VISIBLE_DEVICES`` nor excluded."""
    visible = None if criteria.visible_devices is None else {
        u.uuid for u in resolve_visible(criteria.visible_devices, gpus)}
    return {u.uuid for u in selectable_units(gpus) if u.uuid is not None
            and (visible is None or u.uuid in visible) and not _is_excluded(u, criteria.exclude)}


def evaluate(gpus: list[GpuSnapshot], criteria: Criteria,
             busy: Mapping[str, str] | None = None) -> list[tuple[GpuSnapshot, list[str]]]:
    """Each selectable unit with the reasons it fails (an empty list: it qualifies).

    Args:
        gpus: physical GPUs from :func:`list_gpus` (MIG GPUs are expanded to their devices).
        criteria: from :func:`make_criteria`.
        busy: UUID -> why another job has it (claimed, reserved for an older waiter).
    """
    visible = None if criteria.visible_devices is None else {
        u.uuid for u in resolve_visible(criteria.visible_devices, gpus)}
    busy = busy or {}
    me = current_user()
    out = []
    for unit in selectable_units(gpus):
        why: list[str] = []
        if unit.usable:
            if visible is not None and unit.uuid not in visible:
                why.append(f"hidden by {ENV_VAR}={criteria.visible_devices!r}")
            if _is_excluded(unit, criteria.exclude):
                why.append("excluded")
        why.extend(failures(unit, criteria, me))
        if unit.uuid is not None and unit.uuid in busy:
            why.append(busy[unit.uuid])
        out.append((unit, why))
    return out


def _rank_key(order: str) -> Callable[[GpuSnapshot], tuple[float, ...]]:
    def key(u: GpuSnapshot) -> tuple[float, ...]:
        free = -(u.memory_free_bytes or 0)
        util = u.utilization_gpu_pct if u.utilization_gpu_pct is not None else math.inf
        tail = (len(u.processes), u.index, u.gpu_instance_id or 0)
        if order == "free-memory":
            return (free, util, *tail)
        if order == "utilization":
            return (util, free, *tail)
        return (u.index, u.gpu_instance_id or 0)

    return key


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise ConfigurationError(f"order={order!r} is not known; choose one of: {', '.join(ORDERS)}.")


def rank(units: Sequence[GpuSnapshot], order: str = "free-memory") -> list[GpuSnapshot]:
    """Sort qualifying units best first by ``order`` (see the module docstring for tie-breaks)."""
    check_order(order)
    return sorted(units, key=_rank_key(order))


def check_count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigurationError(f"count={count!r}: give the number of GPUs wanted, a whole number >= 1.")
    return count


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
