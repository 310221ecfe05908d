"""What a GPU must be to qualify (:class:`Criteria`, :func:`failures`) and how the qualifying ones
are ranked (:func:`rank`): shared by the selection (``_select.py``) and the fair queue (``_queue.py``).

Ranking (``order``), best first, ties broken left to right:

* ``"free-memory"`` (default): most free memory, then lower GPU utilization (unknown counts as
  busiest), then fewer processes, then lower NVML index (then MIG instance id).
* ``"utilization"``: lower GPU utilization, then most free memory, fewer processes, lower index.
* ``"index"``: NVML index order (``nvidia-smi`` order), MIG devices by instance id.
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
from gpukit.devices._snapshot import GpuSnapshot, selectable_units
from gpukit.devices._visible import ENV_VAR, resolve_visible
from gpukit.errors import ConfigurationError

__all__ = ["ORDERS", "Criteria", "allowed_units", "check_count", "check_exclude", "check_order", "current_user",
           "evaluate", "failures", "make_criteria", "rank"]

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
