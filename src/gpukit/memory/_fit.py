"""``fit``: the cheapest training configuration whose planned peak fits the device memory.

Candidates: precision (32-true, bf16-mixed, bf16-true) x activation checkpointing (none,
selective, full; only where the model has blocks) x strategy (single, DDP, FSDP, FSDP with
CPU offload, pipeline; the multi-device ones with ``devices > 1``) x micro-batch size (the
global batch per device, halved while it divides, with gradient accumulation making up the
global batch), and tensor-parallel groups of every degree that divides the devices, fits in one
node and divides the model (``_fit_tensor.py``). Memory per device comes from :func:`estimate_memory` (and
:func:`shard_estimate` for FSDP); step time from the cost model in ``_fit_costs.py``. The
search (``_fit_search.py``) ranks every candidate by predicted step time from a few plans and
then plans the cheapest ones exactly, so what is printed is what the planner predicts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpukit._util.units import format_bytes, parse_size
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout, plan_layout, plan_names
from gpukit.memory._activation import checkpoint_targets
from gpukit.memory._blocks import unit_param_counts, units_to_shard
from gpukit.memory._fit_costs import DEFAULT_TENSOR_LINK_BYTES_PER_S, Costs, FitOption
from gpukit.memory._fit_planner import FitPlanner, example_batch_size
from gpukit.memory._fit_search import Candidate, micro_batches, search
from gpukit.memory._fit_tensor import TensorDegrees, tensor_degrees, tensor_lines
from gpukit.memory._planner import same_model
from gpukit.precision import fsdp_own_unit_layers

__all__ = ["FitOption", "FitPlanner", "FitResult", "fit", "example_batch_size", "PRECISIONS", "STRATEGIES"]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
CHECKPOINTING = ("none", "selective", "full")
#: the planner's names for what it plans, from the strategy registry (``gpukit.layout``)
STRATEGIES = plan_names()


@dataclass(frozen=True)
class FitResult:
    """Ranked configurations that fit (cheapest first), or the closest one and what it lacks."""

    memory_bytes: int
    global_batch: int
    options: tuple[FitOption, ...]
    closest: FitOption | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the cheapest configuration left out for memory (it predicts a faster step than ``best``)
    cheaper_rejected: FitOption | None = None
    #: one line per tensor-parallel degree considered: refused (why), or chosen or not (why)
    tensor: tuple[str, ...] = ()
    #: the intra-node link the tensor groups' collectives were priced at (an assumption)
    tensor_link_bytes_per_s: float = DEFAULT_TENSOR_LINK_BYTES_PER_S

    def _tensor_lines(self) -> list[str]:
        if not self.tensor:
            return []
        head = (f"  tensor parallel (collectives priced over an assumed {self.tensor_link_bytes_per_s / 1e9:.0f} GB/s "
                "intra-node link):")
        return [head, *(f"    {line}" for line in self.tensor)]

    @property
    def best(self) -> FitOption | None:
        return self.options[0] if self.options else None

    def __str__(self) -> str:
        head = f"fit: global batch {self.global_batch}, {format_bytes(self.memory_bytes)} per device"
        if not self.options:
            lines = [f"{head}: nothing fits."]
            if self.closest is not None:
                short = self.closest.peak_bytes - self.memory_bytes
                lines.append(f"  closest: {self.closest.describe()}")
                lines.append(f"  it needs {format_bytes(short)} more per device "
                             f"({self.closest.peak_bytes / self.memory_bytes:.2f}x the budget): add devices "
                             "(--nproc / devices=), a smaller global batch, or a GPU with more memory.")
            return "\n".join(lines + self._tensor_lines() + [f"  note: {n}" for n in self.notes])
        lines = [f"{head}; cheapest first:"]
        for rank, option in enumerate(self.options, 1):
            lines.append(f"  {rank}. {option.describe()}")
            lines.append(f"     {option.session_line()}")
        return "\n".join(lines + self._tensor_lines() + [f"  note: {n}" for n in self.notes])


def fit(
    model: torch.nn.Module,
    example_input: Any,
    *,
    memory: str | int,
    devices: int = 1,
    optimizer: Any = "adam",
    global_batch: int | None = None,
    device: str = "cuda",
    strategies: Sequence[str] | None = None,
    precisions: Sequence[str] = PRECISIONS,
    checkpointing: Sequence[str] = CHECKPOINTING,
    top: int = 5,
    flops_per_s: float = 100e12,
    link_bytes_per_s: float = 100e9,
    host_bytes_per_s: float = 20e9,
    micro_batch_overhead_s: float = 2e-3,
    planner: FitPlanner | None = None,
    workers: int = 1,
    progress: Callable[[str], None] | None = None,
    tensor_parallel: Sequence[int] | str | None = None,
    node_devices: int | None = None,
    tensor_link_bytes_per_s: float = DEFAULT_TENSOR_LINK_BYTES_PER_S,
) -> FitResult:
    """Rank the configurations whose planned peak fits ``memory`` per device by predicted step time.

    Args:
        model: the model (not modified).
        example_input: one global batch (dim 0 of every tensor is the batch): a tensor, tuple
            or dict, as for :func:`estimate_memory`; only shapes and dtypes are used.
        memory: memory per device: ``"24GiB"`` or bytes.
        devices: devices available (multi-device strategies need 2 or more).
        optimizer: as for :func:`estimate_memory`.
        global_batch: samples per optimizer step (default: dim 0 of ``example_input``).
        device: the device type planned for ("cuda"; "cpu" to check against CPU allocations).
        strategies: restrict to some of ``STRATEGIES``.
        precisions, checkpointing: restrict the precisions and checkpointing policies
            ("none", "selective", "full") considered (each one costs two planner runs).
        top: how many configurations to return.
        flops_per_s, link_bytes_per_s, host_bytes_per_s, micro_batch_overhead_s: the cost
            model's constants (fp32 FLOP/s; 16-bit precisions run at twice it).
        planner: a :class:`FitPlanner` of this model and input from an earlier call: its plans
            are reused (ranking again for another budget or subset plans only what is new).
        workers: processes that plan side by side (forked from this one; the figures are the
            same). 1 plans here, one after another; ``gpukit plan --fit`` uses the CPUs it may
            run on. Forking is skipped where it is unsafe (other threads running).
        progress: called with one line before each plan is made (a plan of a deep model takes
            about half a second of CPU); ``gpukit plan --fit`` shows it on a terminal.
        tensor_parallel: the tensor-parallel degrees the strategies of one device per process are planned
            with too: ``"auto"`` every degree >= 2 that divides ``devices``, ``()`` none; ``None`` (the
            default) is "auto" unless ``strategies`` is given, which then plans the layouts it names only
            ("ddp", "fsdp+tp2", "tp2"). A degree must fit in one node and divide the model's heads and MLP
            widths; ``FitResult.tensor`` says why each was chosen or not, or refused.
        node_devices: GPUs of one node (default ``devices``): tensor groups stay inside a node.
        tensor_link_bytes_per_s: the intra-node link the tensor groups' collectives are priced at.

    Returns:
        A :class:`FitResult`; ``print`` it for the table and the ``Session(...)`` lines.

    Raises:
        ConfigurationError: a bad ``memory``, ``devices``, batch or strategy name.
        MemoryPlanError: the model cannot run on fake tensors.
    """
    budget = parse_size(memory)
    if budget < 1:
        raise ConfigurationError(f"fit(memory={memory!r}): that is {budget} bytes; give the memory of one device, "
                                 "e.g. memory='24GiB'.")
    batch = _global_batch(devices, global_batch, example_input)
    chosen, notes = _strategies(strategies, devices, model)
    policies = _policies(model, precisions, checkpointing, notes)
    # FSDP's units as the Session would make them: norm layers of their own under some precisions
    units = {p: unit_param_counts(model, units_to_shard(model, always=fsdp_own_unit_layers(p))) for p in precisions}
    planner = _planner_for(planner, model, example_input, optimizer, device)
    if progress is not None:
        planner.progress = progress

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"fit(workers={workers!r}): use an int >= 1 (1 plans in this process).")
    node = devices if node_devices is None else node_devices
    if isinstance(node, bool) or not isinstance(node, int) or node < 1:
        raise ConfigurationError(f"fit(node_devices={node_devices!r}): use an int >= 1 (the GPUs of one node).")

    with same_model():  # one model, planned many times: its structure is found once
        degrees = _tensor(chosen, strategies, tensor_parallel, planner, devices, node, precisions)
        costs = Costs(flops_per_s, link_bytes_per_s, host_bytes_per_s, micro_batch_overhead_s, units,
                      tensor_link_bytes_per_s, degrees.costs)
        grid = [Candidate(precision, ckpt, layout, per_device, micro) for precision in precisions
                for ckpt in policies for layout in chosen for per_device in _per_device(layout, batch)
                for micro in micro_batches(per_device)]
        found = search(grid, planner, costs, budget, top, workers)
        lines = _why(degrees, grid, found.fitting, planner, costs, budget, workers, tensor_link_bytes_per_s)
    _tight(found.fitting, budget, device, notes)
    return FitResult(budget, batch, found.fitting, found.closest, tuple(notes), found.rejected, tuple(lines),
                     tensor_link_bytes_per_s)


#: the share of a device's memory a best plan may take before the result says the rest may not be enough
TIGHT_SHARE = 0.9


def _tight(fitting: Sequence[FitOption], budget: int, device: str, notes: list[str]) -> None:
    """A note when the best plan leaves less of a GPU's budget than what is not planned usually takes."""
    if not fitting or torch.device(device).type == "cpu" or fitting[0].peak_bytes <= budget * TIGHT_SHARE:
        return
    left = budget - fitting[0].peak_bytes
    notes.append(f"the best plan leaves {format_bytes(left)} ({left / budget:.0%}) of the budget; the CUDA context, "
                 "cuBLAS/cuDNN workspaces and the caching allocator's rounding and fragmentation are not planned and "
                 f"usually take 5-10%: give what torch can use, not the device's size (Session(fit=True) budgets "
                 f"{TIGHT_SHARE:.0%} of the free memory)")


def _tensor(chosen: list[Layout], strategies: Sequence[str] | None, tensor_parallel: Sequence[int] | str | None,
            planner: FitPlanner, devices: int, node: int, precisions: Sequence[str]) -> TensorDegrees:
    """The tensor-parallel degrees to plan; ``chosen`` gains their layouts (those of ``tensor_parallel``
    added, those ``strategies`` named checked).

    Raises:
        ConfigurationError: a bad ``tensor_parallel``, or a layout named in ``strategies`` whose degree the model
            or the node refuses.
    """
    named = sorted({layout.tensor for layout in chosen if layout.tensor > 1})
    if tensor_parallel is None:
        tensor_parallel = "auto" if strategies is None else ()
    if isinstance(tensor_parallel, str):
        if tensor_parallel != "auto":
            raise ConfigurationError(f"fit(tensor_parallel={tensor_parallel!r}): use 'auto', a list of degrees, "
                                     "or () for none.")
        wanted = None
    else:
        wanted = list(dict.fromkeys([*tensor_parallel, *named]))
    if devices == 1 or wanted == []:
        return TensorDegrees()
    degrees = tensor_degrees(planner, devices, wanted, node, precisions)
    refused = [f"tensor_parallel={t}: {degrees.refused[t]}" for t in named if t in degrees.refused]
    if refused:
        raise ConfigurationError(f"fit(strategies={list(strategies or ())!r}): {'; '.join(refused)}.")
    chosen += [layout for layout in degrees.layouts(chosen, devices) if layout not in chosen]
    return degrees


def _why(degrees: TensorDegrees, grid: list[Candidate], fitting: Sequence[FitOption], planner: FitPlanner,
         costs: Costs, budget: int, workers: int, link_bytes_per_s: float) -> list[str]:
    """``FitResult.tensor``: the fastest that fits with each degree and without, searched for where the
    ``top`` options found hold none of them (the planner's plans are shared: little is planned again)."""
    if not degrees.accepted and not degrees.refused:
        return []

    def fastest(tensor: int) -> FitOption | None:
        mine = next((o for o in fitting if o.layout.tensor == tensor), None)
        subset = [c for c in grid if c.layout.tensor == tensor]
        if mine is None and subset and fitting:  # nothing fits at all: no subset of the grid fits either
            mine = next(iter(search(subset, planner, costs, budget, 1, workers).fitting), None)
        return mine

    best = fitting[0] if fitting else None
    return tensor_lines(degrees, best, {t: fastest(t) for t in degrees.accepted},
                        fastest(1) if best is not None and best.layout.tensor > 1 else None, link_bytes_per_s)


def _global_batch(devices: Any, global_batch: Any, example_input: Any) -> int:
    """The checked global batch (dim 0 of ``example_input`` unless given); ``devices`` checked too."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigurationError(f"fit(devices={devices!r}): use an int >= 1.")
    batch = example_batch_size(example_input) if global_batch is None else global_batch
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"fit(global_batch={global_batch!r}): use an int >= 1.")
    return batch


def _policies(model: torch.nn.Module, precisions: Sequence[str], checkpointing: Sequence[str],
              notes: list[str]) -> list[str]:
    """The checkpointing policies worth planning (only "none" for a model without blocks, said in ``notes``)."""
    bad = [p for p in precisions if p not in PRECISIONS] + [c for c in checkpointing if c not in CHECKPOINTING]
    if bad or not precisions or not checkpointing:
        raise ConfigurationError(f"fit: unknown or no precisions/checkpointing {bad or '(empty)'}; choose from "
                                 f"{', '.join(PRECISIONS)} and {', '.join(CHECKPOINTING)}.")
    if _has_blocks(model):
        return list(checkpointing)
    notes.append("no blocks found: activation checkpointing not considered")
    return ["none"]


def _planner_for(planner: FitPlanner | None, model: torch.nn.Module, example_input: Any, optimizer: Any,
                 device: str) -> FitPlanner:
    """The planner given (checked to be of this model, input and device), else a new one."""
    if planner is None:
        return FitPlanner(model, example_input, optimizer, device)
    if planner.model is not model or planner.example is not example_input or planner.device != device:
        raise ConfigurationError("fit(planner=...): the planner was built for another model, example_input or "
                                 "device; build one with FitPlanner(model, example_input, optimizer, device).")
    return planner


def _per_device(layout: Layout, batch: int) -> list[int]:
    """``[samples per device]`` under ``layout``; empty when the batch does not divide over its data-parallel ranks."""
    n = layout.data_parallel_size  # a pipeline's or a tensor group's devices share one batch
    return [batch // n] if batch % n == 0 and batch >= n else []


def _strategies(strategies: Sequence[str] | None, devices: int, model: torch.nn.Module) -> tuple[list[Layout], list[str]]:
    """The layouts to plan (multi-device ones only with ``devices > 1``) and the notes on those left out."""
    known = plan_names()
    names = list(known if strategies is None else strategies)
    # a layout with tensor groups ("fsdp+tp2", "tp2"): plan_layout checks it (and says what is allowed)
    unknown = [s for s in names if s not in known and (devices == 1 or not str(s).rpartition("+")[2].startswith("tp")
                                                       or plan_layout(s, devices) is None)]
    if unknown:
        raise ConfigurationError(f"fit(strategies={names!r}): unknown {unknown}; choose from {', '.join(known)}.")
    # a multi-device plan (its layout over 2 devices uses 2) is planned only with devices > 1
    kept = [name for name in names if devices > 1 or plan_layout(name, 2).devices == 1]
    chosen = list(dict.fromkeys(plan_layout(name, devices) for name in kept))
    staged = [layout for layout in chosen if layout.stages > 1]
    if staged and not isinstance(model, torch.nn.Sequential):
        # split() needs the layers named for other models: not guessed here
        return [layout for layout in chosen if layout.stages == 1], [
            "pipeline not considered: the model is no nn.Sequential (split(layers=[...]) names its layers)"]
    return chosen, []


def _has_blocks(model: torch.nn.Module) -> bool:
    try:
        return bool(checkpoint_targets(model, True))
    except ConfigurationError:
        return False
