"""``CUDA_VISIBLE_DEVICES``: the one parser, and the logical -> physical mapping it implies.

CUDA's rules, as documented by NVIDIA and implemented by ``torch.cuda._parse_visible_devices``:

* a comma-separated list; each entry is an index (``2``; read like ``strtoul``, so ``1gpu`` is
  ``1``), a GPU UUID or a unique prefix of one (``GPU-8932f937``), or a MIG device id
  (``MIG-<uuid>``, or the legacy ``MIG-GPU-<uuid>/<gi>/<ci>``);
* parsing stops at the first invalid entry (a negative index, ``NoDevFiles``, an unknown or
  ambiguous UUID, an index past the last GPU): only the entries before it count;
* the same device named twice makes *no* device visible;
* unset means every GPU; the empty string (or ``-1``) means none.
Logical device ``cuda:N`` is the N-th visible entry; indices in the variable are physical, and
match ``nvidia-smi`` only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA's default is fastest first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping

from gpukit.devices._snapshot import GpuSnapshot, list_gpus

__all__ = [
    "VisibleEntry", "parse_visible_devices", "resolve_visible", "logical_to_physical", "describe_mapping",
    "order_may_differ", "explain_visible", "VISIBLE_DEVICES_ENV",
]

#: the variable CUDA reads to choose and number the GPUs a process sees
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
ENV_VAR = VISIBLE_DEVICES_ENV  # this package's short name for it


@dataclass(frozen=True)
class VisibleEntry:
    """One parsed entry: ``kind`` is ``"index"`` (``value`` an int), ``"uuid"`` (a ``GPU-`` prefix) or ``"mig"``."""

    kind: Literal["index", "uuid", "mig"]
    value: int | str
    raw: str


@dataclass(frozen=True)
class _Parsed:
    entries: list[VisibleEntry]
    stopped_at: str | None  # the first invalid entry; it and the rest were ignored
    duplicate: str | None  # a repeated entry, which hides every device


def _strtoul(text: str) -> int | None:
    digits = text[1:] if text[:1] == "+" else text
    end = 0
    while end < len(digits) and digits[end] in "0123456789":  # ASCII only: str.isdigit() takes '²'
        end += 1
    if not end:
        return None
    # C's strtoul saturates at ULONG_MAX (an index no GPU has); int() of 5,000 digits would raise
    return int(digits[:end]) if end <= 20 else 2**64 - 1


def _parse_entry(item: str) -> VisibleEntry | None:
    if item.startswith("GPU-") and len(item) > 4:
        return VisibleEntry("uuid", item, item)
    if item.startswith("MIG-") and len(item) > 4:
        return VisibleEntry("mig", item, item)
    index = _strtoul(item)
    return None if index is None else VisibleEntry("index", index, item)


def _parse(value: str) -> _Parsed:
    entries: list[VisibleEntry] = []
    for raw in value.split(","):
        entry = _parse_entry(raw.strip())
        if entry is None:
            return _Parsed(entries, raw.strip(), None)
        if any(e.kind == entry.kind and e.value == entry.value for e in entries):
            return _Parsed([], None, entry.raw)
        entries.append(entry)
    return _Parsed(entries, None, None)


def parse_visible_devices(value: str | None) -> list[VisibleEntry] | None:
    """Parse a ``CUDA_VISIBLE_DEVICES`` value by CUDA's rules (see the module docstring).

    This is the syntax step, which needs no GPU; :func:`resolve_visible` then matches UUID
    prefixes and index ranges against the GPUs that exist.

    Args:
        value: the variable's value, or ``None`` when it is unset.

    Returns:
        ``None`` when unset (every GPU is visible), else the entries before the first invalid
        one (``[]`` for ``""``, ``"-1"``, ``"NoDevFiles"`` or a repeated entry).
    """
    if value is None:
        return None
    return _parse(value).entries


def _match_uuid(prefix: str, units: list[GpuSnapshot]) -> GpuSnapshot | None:
    hits = [u for u in units if u.uuid is not None and u.uuid.lower().startswith(prefix.lower())]
    return hits[0] if len(hits) == 1 else None  # unknown or ambiguous: invalid


def _match_mig(entry: str, gpus: list[GpuSnapshot]) -> GpuSnapshot | None:
    migs = [m for g in gpus for m in g.mig_devices]
    if entry.startswith("MIG-GPU-") and entry.count("/") == 2:
        # legacy form MIG-GPU-<parent uuid>/<gpu instance>/<compute instance>
        parent, gi, ci = entry[len("MIG-"):].split("/")
        for m in migs:
            if (m.mig_parent_uuid or "").lower() == parent.lower() and str(m.gpu_instance_id) == gi \
                    and str(m.compute_instance_id) == ci:
                return m
        return None
    return _match_uuid(entry, migs)


def _expand(gpu: GpuSnapshot) -> list[GpuSnapshot]:
    # A MIG-enabled GPU is not a CUDA device itself; CUDA sees its MIG devices.
    return list(gpu.mig_devices) if gpu.mig_enabled and gpu.mig_devices else [gpu]


def _resolve(parsed: _Parsed | None, gpus: list[GpuSnapshot]) -> tuple[list[GpuSnapshot], str | None, str | None]:
    if parsed is None:
        return [u for g in gpus for u in _expand(g)], None, None
    visible: list[GpuSnapshot] = []
    for entry in parsed.entries:
        found: list[GpuSnapshot] | None = None
        if entry.kind == "index":
            found = _expand(gpus[int(entry.value)]) if int(entry.value) < len(gpus) else None
        elif entry.kind == "uuid":
            gpu = _match_uuid(str(entry.value), gpus)
            found = None if gpu is None else _expand(gpu)
        else:
            mig = _match_mig(str(entry.value), gpus)
            found = None if mig is None else [mig]
        if found is None:
            return visible, entry.raw, None
        if any(f.uuid == v.uuid for f in found for v in visible):
            return [], None, entry.raw
        visible.extend(found)
    return visible, parsed.stopped_at, parsed.duplicate


def resolve_visible(value: str | None, gpus: list[GpuSnapshot]) -> list[GpuSnapshot]:
    """The devices CUDA would number ``cuda:0, cuda:1, ...`` for this ``CUDA_VISIBLE_DEVICES`` value."""
    return explain_visible(value, gpus)[0]


def explain_visible(value: str | None, gpus: list[GpuSnapshot]) -> tuple[list[GpuSnapshot], str | None, str | None]:
    """:func:`resolve_visible`, and why CUDA stops there: ``(visible, stopped_at, duplicate)``.

    ``stopped_at`` is the entry CUDA cannot match (it ignores it and everything after it);
    ``duplicate`` an entry named twice (CUDA then hides every GPU). Both ``None``: all of it counts.
    """
    return _resolve(None if value is None else _parse(value), gpus)


def logical_to_physical(env: Mapping[str, str] | None = None,
                        gpus: list[GpuSnapshot] | None = None) -> list[tuple[int, GpuSnapshot]]:
    """Map logical CUDA device numbers to physical GPUs.

    Args:
        env: environment to read ``CUDA_VISIBLE_DEVICES`` from (default ``os.environ``).
        gpus: snapshots to resolve against (default: :func:`list_gpus` now).

    Returns:
        ``[(0, <GPU 2 snapshot>), (1, <GPU 3 snapshot>)]`` for ``CUDA_VISIBLE_DEVICES=2,3``;
        ``[]`` without GPUs or when every GPU is hidden.
    """
    env = os.environ if env is None else env
    gpus = list_gpus() if gpus is None else gpus
    return list(enumerate(resolve_visible(env.get(ENV_VAR), gpus)))


def describe_mapping(env: Mapping[str, str] | None = None, gpus: list[GpuSnapshot] | None = None) -> str:
    """Human-readable logical -> physical mapping, for display and error messages.

    Example::

        CUDA_VISIBLE_DEVICES=2,3 (CUDA_DEVICE_ORDER=PCI_BUS_ID)
          cuda:0 -> GPU 2 NVIDIA A100-SXM4-40GB (GPU-1a2b3c4d…)
          cuda:1 -> GPU 3 NVIDIA A100-SXM4-40GB (GPU-5e6f7a8b…)
    """
    env = os.environ if env is None else env
    gpus = list_gpus() if gpus is None else gpus
    value = env.get(ENV_VAR)
    order = env.get("CUDA_DEVICE_ORDER")
    head = f"{ENV_VAR} is unset" if value is None else f"{ENV_VAR}={value!r}"
    head += f" (CUDA_DEVICE_ORDER={order})" if order else " (CUDA_DEVICE_ORDER unset: CUDA numbers fastest first)"
    if not gpus:
        from gpukit.devices import _nvml

        return f"{head}\n  {_nvml.unavailable_reason() or 'no NVIDIA GPU found'}"
    visible, stopped_at, duplicate = _resolve(None if value is None else _parse(value), gpus)
    lines = [head]
    for logical, unit in enumerate(visible):
        state = "" if unit.usable else f" [unusable: {unit.error}]"
        lines.append(f"  cuda:{logical} -> GPU {unit.index} {unit.name or 'name n/a'} ({unit.short_uuid}){state}")
    if duplicate is not None:
        lines.append(f"  {duplicate!r} is named twice, so CUDA hides every GPU")
    elif stopped_at is not None:
        lines.append(f"  {stopped_at!r} is not a GPU here, so CUDA ignores it and every entry after it")
    if not visible and duplicate is None:
        lines.append("  no GPU is visible to CUDA")
    if order_may_differ(env, gpus):
        lines.append("  note: mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA's numbering "
                     "may differ from nvidia-smi's; gpukit.devices.use_gpus() sets PCI_BUS_ID")
    return "\n".join(lines)


def order_may_differ(env: Mapping[str, str], gpus: list[GpuSnapshot]) -> bool:
    """Whether CUDA's device numbering may differ from nvidia-smi's (PCI bus) order.

    CUDA's default ``CUDA_DEVICE_ORDER=FASTEST_FIRST`` puts the fastest GPU first and breaks
    ties by PCI bus id, so only a mix of GPU models without ``PCI_BUS_ID`` reorders them.
    """
    return env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({g.name for g in gpus if g.name}) > 1
