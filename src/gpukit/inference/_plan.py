"""``plan_inference``: where each unit of a model goes for a stated workload, what each device holds at
its peak, and the tokens/s that placement can reach at best -- on the meta device, before any weight
is read. A workload that cannot fit is refused with its numbers and what would fit instead."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gpukit._util.units import format_bytes
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.inference._bandwidth import (HOST_PROBE_BYTES, HOST_TO_GPU_BYTES_PER_S, gpu_memory_bandwidth,
                                         host_memory_bandwidth, host_probe_pending)
from gpukit.inference._budget import budgets, describe_budgets
from gpukit.inference._placement import CPU, DISK, GPU, DeviceBudget, Placement, UnitCost, place
from gpukit.inference._quantized import quantize_linear_weights, weights_kind
from gpukit.memory import check_workload, forward_units, kv_shape

__all__ = ["InferencePlan", "Workload", "plan_inference", "workload_input"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Workload:
    """What a plan is for: ``batch_size`` sequences of ``prompt_len`` tokens, ``new_tokens`` generated."""

    batch_size: int
    prompt_len: int
    new_tokens: int
    dtype: torch.dtype
    weights: str | None = None  # "int8"/"float8": Linear weights stored quantised (``_quantized.py``)

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.new_tokens


@dataclass(frozen=True)
class DevicePlan:
    """One device of a plan: its budget, what it holds at its peak, the units on it."""

    name: str
    kind: str
    budget_bytes: int | None
    peak_bytes: int
    weights_bytes: int
    units: tuple[str, ...]


@dataclass(frozen=True)
class InferencePlan:
    """An inference placement (see :func:`plan_inference`).

    Attributes:
        model: the model's class name.
        workload: what it was planned for.
        device_map: unit name -> device (``"cuda:0"``, ``"cpu"``, ``"disk"``).
        devices: per device: budget, predicted peak, weights, units.
        execution_device: where the offloaded units run (the last GPU; the CPU without GPUs).
        offloaded: units streamed to the execution device for every forward.
        prefetch: offloaded units read ahead of the one computing.
        tokens_per_s_bound: decode tokens/s this placement cannot beat (bytes each token reads over
            the bandwidth that carries them); ``None`` when a bandwidth is unknown.
        bytes_per_token: bytes read per decode token by where they come from.
        unit_bytes: each unit's weights (a tied tensor counted in its first unit only).
        notes: assumptions the figures rest on.
    """

    model: str
    workload: Workload
    device_map: dict[str, str]
    devices: tuple[DevicePlan, ...]
    execution_device: str
    offloaded: tuple[str, ...]
    prefetch: int
    tokens_per_s_bound: float | None
    bytes_per_token: dict[str, int]
    unit_bytes: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def peak_bytes(self, device: str) -> int:
        """The predicted peak of ``device``."""
        return next(d.peak_bytes for d in self.devices if d.name == device)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["workload"] = {**asdict(self.workload), "dtype": str(self.workload.dtype).replace("torch.", "")}
        return out

    def __str__(self) -> str:
        w = self.workload
        lines = [f"inference plan: {self.model}, batch {w.batch_size} x ({w.prompt_len} prompt + {w.new_tokens} new) "
                 f"tokens, {str(w.dtype).replace('torch.', '')}" + (f", Linear weights {w.weights}" if w.weights else ""),
                 f"  {'device':<9}{'budget':>12}{'peak':>12}{'weights':>12}  units"]
        for d in self.devices:
            budget = format_bytes(d.budget_bytes) if d.budget_bytes is not None else "unlimited"
            span = f"{d.units[0]} .. {d.units[-1]} ({len(d.units)})" if len(d.units) > 1 else (d.units[0] if d.units else "-")
            lines.append(f"  {d.name:<9}{budget:>12}{format_bytes(d.peak_bytes):>12}{format_bytes(d.weights_bytes):>12}  {span}")
        if self.offloaded:
            lines.append(f"  offloaded: {len(self.offloaded)} unit(s) streamed to {self.execution_device}, "
                         f"{self.prefetch} read ahead of the one computing")
        bound = f"{self.tokens_per_s_bound:.3g}" if self.tokens_per_s_bound is not None else "n/a"
        reads = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.bytes_per_token.items() if v)
        lines.append(f"  tokens/s bound: {bound} (per token it reads {reads})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def workload_input(model: nn.Module, workload: Workload) -> dict[str, torch.Tensor]:
    """The prefill input of a Hugging Face-style model for ``workload`` (token ids on meta)."""
    return {"input_ids": torch.empty(workload.batch_size, workload.prompt_len, dtype=torch.int64, device="meta")}


def as_dtype(dtype: torch.dtype | str | None, model: nn.Module) -> torch.dtype:
    """``dtype`` as a floating torch dtype (default: the model's own)."""
    if dtype is None:  # a quantised weight (float8: floating too, one byte) is not the compute dtype
        return next((p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1),
                    torch.float32)
    if isinstance(dtype, str) and dtype.replace("torch.", "") in _DTYPES:
        return _DTYPES[dtype.replace("torch.", "")]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    raise ConfigurationError(f"dtype={dtype!r}: expected one of {', '.join(_DTYPES)} (or torch.float16, ...).")


def plan_inference(
    model: nn.Module,
    *,
    batch_size: int = 1,
    prompt_len: int | None = None,
    new_tokens: int = 0,
    dtype: torch.dtype | str | None = None,
    example_input: Any = None,
    max_memory: Mapping[str | int, str | int] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    prefetch: int = 1,
    disk_bytes_per_s: float | None = None,
    devices: list[DeviceBudget] | None = None,
    weights: str | None = None,
) -> InferencePlan:
    """Plan where ``model``'s units go for a workload, on the meta device (nothing is read or allocated).

    Args:
        model: the model, on any device (``meta`` is best: nothing of it is used but shapes).
        batch_size, prompt_len, new_tokens: the workload of a Hugging Face-style model (its config says
            the KV cache's shape); ``prompt_len`` is required for such a model.
        dtype: the weights' dtype when run (default: the model's).
        example_input: for a plain ``nn.Module``: its input (``model(x)``, ``model(*tuple)``,
            ``model(**dict)``), which defines the workload instead.
        max_memory: budget per device (``{"cuda:0": "20GiB", "cpu": "64GiB", "disk": "1TiB"}``); default:
            what is free now less a margin (see ``_budget.py``).
        offload_dir: where disk-placed weights live (lists ``disk`` when ``max_memory`` does not).
        prefetch: offloaded units read ahead of the one computing (1 or more).
        disk_bytes_per_s: measured disk read bandwidth, for the tokens/s bound.
        devices: the budgets already made (tests; overrides ``max_memory``).
        weights: ``"int8"`` or ``"float8"``: plan each ``nn.Linear`` weight stored quantised per output row
            (``gpukit.inference.quantize_linear_weights``), the transient upcast copy of each in its unit's
            activations. The plan is made on a copy with its parameters on meta: ``model`` is left as it is.

    Returns:
        An :class:`InferencePlan`.

    Raises:
        ConfigurationError: a workload or budget that is not one.
        MemoryPlanError: it cannot fit (the message has the numbers and what would fit).
    """
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
        raise ConfigurationError(f"prefetch={prefetch!r}: expected a whole number of units to read ahead, at least 1.")
    weights_dtype = as_dtype(dtype, model)
    weights = weights_kind(weights)
    kv = kv_shape(model)
    if example_input is None:
        if kv is None:
            raise ConfigurationError(
                f"{type(model).__name__} has no Hugging Face config saying its layers and heads: give "
                "example_input=... (its input at the planned size) to define the workload.")
        if prompt_len is None:
            raise ConfigurationError("prompt_len=... is needed: the prompt's length in tokens (with batch_size and "
                                     "new_tokens it sizes the KV cache and the activations).")
    check_workload(batch_size, prompt_len if prompt_len is not None else 1, new_tokens)
    workload = Workload(batch_size, prompt_len or 1, new_tokens, weights_dtype, weights)
    example = example_input if example_input is not None else workload_input(model, workload)
    if weights is not None:
        model = _meta_copy(model, f"plan_inference(weights={weights!r})")  # the caller's model is not changed
        quantize_linear_weights(model, weights, weights_dtype)
    figures = forward_units(model, example, weights_dtype)
    costs = [_cost(u, kv, workload) for u in figures]
    devices = devices if devices is not None else budgets(max_memory, offload_dir)
    placement = place(costs, devices, prefetch)
    if placement is None:
        quantised = _quantised_costs(model, example, workload, kv)
        raise MemoryPlanError(_refusal(model, costs, devices, workload, prefetch, kv is not None, quantised))
    return _result(model, costs, devices, placement, workload, prefetch, disk_bytes_per_s)


def _cost(unit: Any, kv: Any, workload: Workload) -> UnitCost:
    has_kv = kv is not None and unit.layer is not None
    return UnitCost(
        unit.name, unit.weights_bytes,
        kv.layer_bytes(workload.batch_size, workload.prompt_len, workload.dtype) if has_kv else 0,
        kv.layer_bytes(workload.batch_size, workload.tokens, workload.dtype) if has_kv else 0,
        unit.live_in_bytes, unit.peak_above_bytes, unit.tied_to)


def _scaled(costs: list[UnitCost], per_token: float, weights: float) -> list[UnitCost]:
    """Costs with the workload's memory scaled by ``per_token`` and the weights by ``weights``."""
    return [replace(c, weights_bytes=int(c.weights_bytes * weights), kv_prompt_bytes=int(c.kv_prompt_bytes * per_token),
                    kv_full_bytes=int(c.kv_full_bytes * per_token), live_in_bytes=int(c.live_in_bytes * per_token),
                    peak_above_bytes=int(c.peak_above_bytes * per_token)) for c in costs]


def _meta_copy(model: nn.Module, why: str) -> nn.Module:
    """A copy of ``model`` with every parameter on meta (shapes and dtypes: what a plan reads) and its
    buffers copied as they are (small, and some are read by the forward: rotary frequencies)."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                            for p in model.parameters()}
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - a module that cannot be copied: say what to do instead
        raise ConfigurationError(
            f"{why} plans a copy of {type(model).__name__} (the model itself is not changed), and it could not be "
            f"copied ({type(exc).__name__}: {exc}). Build the model on the meta device "
            "(`with torch.device('meta'): model = ...`) and plan that.") from exc


def _quantised_costs(model: nn.Module, example: Any, workload: Workload, kv: Any) -> list[UnitCost] | None:
    """The units' costs with int8 Linear weights, for a refusal to say whether they would fit; ``None``
    when already quantised, nothing would be, or the model cannot be copied."""
    if workload.weights is not None:
        return None
    try:
        quantised = _meta_copy(model, "a refusal's int8 re-plan")
    except ConfigurationError:  # the refusal stands without the suggestion
        return None
    if not quantize_linear_weights(quantised, "int8", workload.dtype):
        return None
    try:
        return [_cost(u, kv, workload) for u in forward_units(quantised, example, workload.dtype)]
    except MemoryPlanError:  # the refusal stands without the suggestion
        return None


def _refusal(model: nn.Module, costs: list[UnitCost], devices: list[DeviceBudget], workload: Workload,
             prefetch: int, generative: bool, quantised: list[UnitCost] | None = None) -> str:
    weights = sum(c.weights_bytes for c in costs)
    kv = sum(c.kv_full_bytes for c in costs)
    act = max(c.activations_bytes for c in costs)
    w = workload
    lines = [f"Cannot place {type(model).__name__} for batch {w.batch_size} x {w.tokens} tokens "
             f"({str(w.dtype).replace('torch.', '')}): it needs {format_bytes(weights)} of weights, "
             f"{format_bytes(kv)} of KV cache and {format_bytes(act)} of activations at the peak, and the budget is "
             f"{describe_budgets(devices)}" + ("" if any(d.kind == DISK for d in devices) else " (no disk listed)") + "."]
    fits: list[str] = []
    batch = w.batch_size // 2
    while batch >= 1 and not fits:
        if place(_scaled(costs, batch / w.batch_size, 1.0), devices, prefetch) is not None:
            fits.append(f"batch_size={batch}")
        batch //= 2
    if generative:
        tokens = w.tokens // 2
        while tokens >= 2 and place(_scaled(costs, tokens / w.tokens, 1.0), devices, prefetch) is None:
            tokens //= 2
        if tokens >= 2:
            fits.append(f"a context of about {tokens} tokens (prompt + new)")
    # quantised Linear weights keep their bytes in bfloat16 (only their scales and the other weights halve):
    # the suggestion is made only if it fits with the weights counted whole
    halved = 0.5 if w.weights is None else 1.0
    if w.dtype.itemsize > 2 and place(_scaled(costs, 0.5, halved), devices, prefetch) is not None:
        fits.append("dtype=torch.bfloat16 (half the weights and KV cache)" if w.weights is None else
                    "dtype=torch.bfloat16 (half the KV cache and activations)")
    if quantised is not None and place(quantised, devices, prefetch) is not None:
        fits.append("weights='int8' (each nn.Linear weight in one byte with a scale per row, upcast per forward)")
    if not any(d.kind == DISK for d in devices):
        fits.append("offload_dir=... (or 'disk' in max_memory) to stream what does not fit from disk")
    lines.append("What would fit: " + "; ".join(fits) + "." if fits else
                 "Nothing smaller fits either: give more memory (max_memory) or more devices.")
    return " ".join(lines)


def _result(model: nn.Module, costs: list[UnitCost], devices: list[DeviceBudget], placement: Placement,
            workload: Workload, prefetch: int, disk_bytes_per_s: float | None) -> InferencePlan:
    device_of = placement.device_of
    kind = {d.name: d.kind for d in devices}
    reads: dict[str, int] = {}
    for c in costs:  # every weight is read once per decode token, with the KV cache of its layer
        source = device_of[c.name]
        reads[source] = reads.get(source, 0) + c.weights_bytes
        reads[placement.execution_device] = reads.get(placement.execution_device, 0) + c.kv_full_bytes
    notes: list[str] = []
    probe_pending = host_probe_pending()
    bound = _bound(reads, kind, placement.execution_device, disk_bytes_per_s, notes)
    peaks = dict(placement.peak_bytes)
    if probe_pending and not host_probe_pending():  # this plan ran the host probe: the process held its buffer
        for name in (d.name for d in devices if d.kind == CPU):
            peaks[name] = max(peaks[name], HOST_PROBE_BYTES)
        notes.append(f"the host-bandwidth probe held {format_bytes(HOST_PROBE_BYTES)} before any weight was read: "
                     "the cpu peak is at least that")
    plans = tuple(DevicePlan(d.name, d.kind, d.budget_bytes, peaks[d.name],
                             sum(c.weights_bytes for c in costs if device_of[c.name] == d.name),
                             tuple(c.name for c in costs if device_of[c.name] == d.name)) for d in devices)
    if any(c.tied_to for c in costs):
        notes.append("tied weights counted once, where their first user sits")
    return InferencePlan(type(model).__name__, workload, dict(device_of), plans, placement.execution_device,
                         placement.offloaded, prefetch, bound, reads,
                         {c.name: c.weights_bytes for c in costs}, tuple(notes))


def _bound(reads: dict[str, int], kind: dict[str, str], execution: str, disk_bytes_per_s: float | None,
           notes: list[str]) -> float | None:
    """Decode tokens/s no run of this placement beats: streaming overlaps compute, so the slower of
    (the execution devices reading their memory) and (the offloaded bytes arriving) bounds it."""
    compute_s = stream_s = 0.0
    for device, nbytes in reads.items():
        if not nbytes:
            continue
        if kind[device] == GPU:
            bandwidth = gpu_memory_bandwidth(int(device.split(":")[1]))
            if bandwidth is None:
                notes.append(f"{device}'s memory bandwidth is not in gpukit's data-sheet table: no tokens/s bound")
                return None
            compute_s += nbytes / bandwidth
        elif kind[device] == CPU:
            if kind.get(execution) == GPU:
                stream_s += nbytes / HOST_TO_GPU_BYTES_PER_S
                notes.append(f"host -> GPU copies at {HOST_TO_GPU_BYTES_PER_S / 1e9:g} GB/s assumed (PCIe 4.0 x16)")
            else:
                compute_s += nbytes / host_memory_bandwidth()
        else:  # disk
            if disk_bytes_per_s is None:
                notes.append("disk bandwidth not measured (it is when loading): no tokens/s bound")
                return None
            stream_s += nbytes / disk_bytes_per_s
            notes.append(f"disk reads at {disk_bytes_per_s / 1e9:.3g} GB/s, measured cold: what the page cache "
                         "serves arrives faster, and a run can beat this bound")
            if kind.get(execution) == CPU:
                compute_s += nbytes / host_memory_bandwidth()
    if kind.get(execution) == CPU and compute_s:
        notes.append(f"host memory streams {host_memory_bandwidth() / 1e9:.3g} GB/s (measured)")
    slowest = max(compute_s, stream_s)
    return 1.0 / slowest if slowest > 0 else None
