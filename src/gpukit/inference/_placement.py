"""Where each unit of a model goes for inference: contiguous ranges over the GPUs, then CPU RAM, then disk.

Pure arithmetic over the planner's per-unit figures (``gpukit.memory.forward_units``) and the
devices' budgets: no torch tensor is made here.

What a device must hold at its peak (``device_peak``): the weights resident on it; the KV cache
of the layers that run on it, either at the end of the prompt plus the prompt's activations
(prefill), or full length plus one more layer's worth while ``torch.cat`` grows it (the last
decode step); and, on the device that runs the offloaded units, ``prefetch + 1`` buffers of the
largest offloaded unit (the one computing, the ones arriving).

The rules, in order:

1. everything fits on the GPUs (or, without GPUs, in CPU RAM): contiguous ranges, balanced so
   that the fullest device is as empty as it can be (memory, and so a memory-bound decode step's
   time on equal GPUs);
2. otherwise the longest prefix that fits goes to the GPUs (every listed GPU gets some: none is
   left empty while anything is offloaded), the rest to CPU RAM while it fits, then to disk --
   and disk only where it was listed;
3. a unit that shares a tensor with an earlier one (tied embeddings) sits where that one does,
   and the tensor is counted once;
4. nothing fits: :class:`~gpukit.errors.MemoryPlanError` with the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["DeviceBudget", "UnitCost", "Placement", "place", "device_peak"]

GPU, CPU, DISK = "gpu", "cpu", "disk"


@dataclass(frozen=True)
class DeviceBudget:
    """One place weights can go.

    Attributes:
        name: ``"cuda:0"``, ``"cpu"``, ``"disk"``.
        kind: ``"gpu"``, ``"cpu"`` or ``"disk"``.
        budget_bytes: what it may hold; ``None`` only for disk (no limit).
    """

    name: str
    kind: str
    budget_bytes: int | None


@dataclass(frozen=True)
class UnitCost:
    """What one unit costs where it runs (bytes); see ``gpukit.memory.ForwardUnit``."""

    name: str
    weights_bytes: int
    kv_prompt_bytes: int
    kv_full_bytes: int
    live_in_bytes: int
    peak_above_bytes: int
    tied_to: str | None = None

    @property
    def activations_bytes(self) -> int:
        return self.live_in_bytes + self.peak_above_bytes


@dataclass(frozen=True)
class Placement:
    """Each unit's device, and what each device holds at its peak."""

    device_of: dict[str, str]
    execution_device: str
    peak_bytes: dict[str, int]
    offloaded: tuple[str, ...]


def device_peak(resident: Sequence[UnitCost], executed: Sequence[UnitCost], streamed_buffers_bytes: int) -> int:
    """Bytes a device holds at its peak: resident weights, plus the KV cache and activations of the
    units it executes (resident or streamed in), plus the streaming buffers."""
    weights = sum(u.weights_bytes for u in resident)
    if not executed:
        return weights + streamed_buffers_bytes
    prefill = sum(u.kv_prompt_bytes for u in executed) + max(u.activations_bytes for u in executed)
    decode = sum(u.kv_full_bytes for u in executed) + max(u.kv_full_bytes for u in executed)
    return weights + streamed_buffers_bytes + max(prefill, decode)


def _buffers(streamed: Sequence[UnitCost], prefetch: int) -> int:
    return (prefetch + 1) * max((u.weights_bytes for u in streamed), default=0)


def pinned_bytes(nbytes: int) -> int:
    """What a pinned host buffer of ``nbytes`` takes: torch's pinned-memory allocator rounds every request up
    to the next power of two (to reuse its cached blocks; always in torch 2.5, by default through 2.13), so
    a 605 MiB layer pinned for a GPU holds 1 GiB of RAM. Planned as taken, not as asked."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _staging(on_disk: Sequence[UnitCost], prefetch: int) -> int:
    """The pinned buffers a GPU's disk reads land in on the host: one per slot, the largest disk unit each."""
    return (prefetch + 1) * pinned_bytes(max((u.weights_bytes for u in on_disk), default=0))


class _Load:
    """Running sums of what one device holds, so adding a unit costs O(1)."""

    def __init__(self, executed: Sequence[UnitCost], buffers: int) -> None:
        self.weights = 0
        self.buffers = buffers
        self.kv_prompt = sum(u.kv_prompt_bytes for u in executed)
        self.kv_full = sum(u.kv_full_bytes for u in executed)
        self.act = max((u.activations_bytes for u in executed), default=0)
        self.layer = max((u.kv_full_bytes for u in executed), default=0)

    def peak_with(self, unit: UnitCost) -> int:
        prefill = self.kv_prompt + unit.kv_prompt_bytes + max(self.act, unit.activations_bytes)
        decode = self.kv_full + unit.kv_full_bytes + max(self.layer, unit.kv_full_bytes)
        return self.weights + unit.weights_bytes + self.buffers + max(prefill, decode)

    def peak(self) -> int:
        """What the device holds with no further unit."""
        return self.weights + self.buffers + max(self.kv_prompt + self.act, self.kv_full + self.layer)

    def add(self, unit: UnitCost) -> None:
        self.weights += unit.weights_bytes
        self.kv_prompt += unit.kv_prompt_bytes
        self.kv_full += unit.kv_full_bytes
        self.act = max(self.act, unit.activations_bytes)
        self.layer = max(self.layer, unit.kv_full_bytes)


def _pack(units: Sequence[UnitCost], devices: Sequence[DeviceBudget], share: float,
          extra: dict[str, tuple[list[UnitCost], int]]) -> dict[str, str] | None:
    """Contiguous ranges of ``units`` over ``devices``, no device above ``share`` of its budget;
    ``None`` if they do not all fit. ``extra[device]``: units it also executes and buffer bytes."""
    out: dict[str, str] = {}
    index = 0
    for position, device in enumerate(devices):
        limit = share * float(device.budget_bytes or 0)
        load = _Load(*extra.get(device.name, ([], 0)))
        taken = 0
        while index < len(units):
            unit = units[index]
            if unit.tied_to is not None and out.get(unit.tied_to, device.name) != device.name:
                out[unit.name] = out[unit.tied_to]  # it sits with the tensor it shares
                index += 1
                continue
            if load.peak_with(unit) > limit:
                break
            load.add(unit)
            out[unit.name] = device.name
            index += 1
            taken += 1
        if not taken and position < len(devices) - 1 and index < len(units):
            return None  # a device left empty before the end
        if load.peak() > limit:
            return None  # what it runs for the offloaded units alone does not fit
    return out if index == len(units) else None


def _tied_fixed(units: Sequence[UnitCost], device_of: dict[str, str]) -> bool:
    """Whether every tied unit landed where its tensor's owner did."""
    return all(u.tied_to is None or device_of.get(u.tied_to) == device_of.get(u.name) for u in units)


def _balanced(units: Sequence[UnitCost], devices: Sequence[DeviceBudget],
              extra: dict[str, tuple[list[UnitCost], int]]) -> dict[str, str] | None:
    """The contiguous split whose fullest device is as empty as possible (bisection on the share)."""
    best = _pack(units, devices, 1.0, extra)
    if best is None:
        return None
    low, high = 0.0, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        found = _pack(units, devices, mid, extra)
        if found is not None and _tied_fixed(units, found):
            best, high = found, mid
        else:
            low = mid
    return best


def place(units: Sequence[UnitCost], devices: Sequence[DeviceBudget], prefetch: int = 1) -> Placement | None:
    """Place ``units`` (in the order the forward runs them) by the rules of the module docstring.

    Args:
        units: the units' costs.
        devices: GPUs first (in order), then at most one ``cpu`` and one ``disk`` entry.
        prefetch: how many offloaded units are read ahead of the one computing.

    Returns:
        The placement, or ``None`` when nothing fits (the caller says why, with numbers).
    """
    gpus = [d for d in devices if d.kind == GPU]
    cpu = next((d for d in devices if d.kind == CPU), None)
    disk = next((d for d in devices if d.kind == DISK), None)
    runners = gpus or ([cpu] if cpu is not None else [])
    if not runners:
        return None
    execution = runners[-1].name  # offloaded units come after the last resident ones: no extra hop
    for split in range(len(units), -1, -1):
        head, tail = list(units[:split]), list(units[split:])
        resident = {t.name for t in head}
        head += [u for u in tail if u.tied_to in resident]  # a tied unit sits with the tensor it shares
        tail = [u for u in tail if u.tied_to not in resident]
        if tail and split < len(gpus) - 1:
            continue  # a GPU would hold nothing while units are offloaded (the last one runs them)
        offload = _offload(tail, cpu if gpus else None, disk, prefetch)
        if offload is None:
            continue
        extra = {execution: (tail, _buffers(tail, prefetch))} if tail else {}
        if _pack(head, runners, 1.0, extra) is None:
            continue
        device_of = (_balanced(head, runners, extra) or {}) if head else {}
        device_of.update(offload)
        return Placement(device_of, execution, _peaks(units, devices, device_of, execution, prefetch),
                         tuple(u.name for u in tail))
    return None


def _offload(tail: list[UnitCost], cpu: DeviceBudget | None, disk: DeviceBudget | None,
             prefetch: int) -> dict[str, str] | None:
    """Offloaded units into CPU RAM (only when GPUs run them) while they fit, then disk; ``None``
    when they fit in neither. With disk in use the host also holds the buffers disk reads land in."""
    room = cpu.budget_bytes if cpu is not None and cpu.budget_bytes is not None else 0
    for reserve in (0, _staging(tail, prefetch)):  # units kept in CPU RAM for a GPU are pinned: planned as taken
        out: dict[str, str] = {}
        held = 0
        for unit in tail:
            if cpu is not None and held + pinned_bytes(unit.weights_bytes) <= room - reserve:
                out[unit.name] = cpu.name
                held += pinned_bytes(unit.weights_bytes)
            elif disk is not None:
                out[unit.name] = disk.name
            else:
                return None
        if cpu is None or all(d != DISK for d in out.values()):
            return out
        if held + _staging([u for u in tail if out[u.name] == DISK], prefetch) <= room:
            return out
    return None


def _peaks(units: Sequence[UnitCost], devices: Sequence[DeviceBudget], device_of: dict[str, str],
           execution: str, prefetch: int) -> dict[str, int]:
    streamed = [u for u in units if device_of[u.name] not in {d.name for d in devices if d.kind == GPU}
                and device_of[u.name] != execution]
    out: dict[str, int] = {}
    for device in devices:
        resident = [u for u in units if device_of.get(u.name) == device.name]
        if device.kind == DISK:
            out[device.name] = sum(u.weights_bytes for u in resident)
            continue
        runs_here = [u for u in resident if device.name == execution or device.kind == GPU]
        executed = runs_here + (streamed if device.name == execution else [])
        buffers = _buffers(streamed, prefetch) if device.name == execution else 0
        if device.kind == CPU and device.name != execution:  # pinned for the GPU; the host stages disk reads
            on_disk = [u for u in streamed if device_of[u.name] == "disk"]
            buffers = _staging(on_disk, prefetch)
            executed = []
            resident = [replace(u, weights_bytes=pinned_bytes(u.weights_bytes)) for u in resident]
        out[device.name] = device_peak(resident, executed, buffers)
    return out
