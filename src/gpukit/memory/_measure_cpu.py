"""Measure a training step's memory on the CPU, by category: the planner's ground truth without a GPU.

Real tensors, real autograd, torch's own CPU allocator: ``torch.profiler`` with
``profile_memory=True`` records every allocation and free, and its memory profile
(``torch.profiler._memory_profiler``, the data behind ``export_memory_timeline``) tells each
one's category from the graph -- parameter, gradient, optimizer state, input, activation,
temporary. Replaying that timeline gives the live bytes at every moment: the peak, each
category's largest value, and the activations (everything neither parameter, gradient,
optimizer state nor input) at their largest inside forward+backward.

It measures what :func:`~gpukit.memory.estimate_memory` predicts for ``device="cpu"``: two
steps from a fresh optimizer, the model and batch already in memory.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpukit.accelerators import get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.memory._activation import checkpointing_applied
from gpukit.memory._planner import OPTIMIZERS
from gpukit.precision import get_precision

__all__ = ["MeasuredMemory", "forward_backward", "measure_step_memory"]

_PERSISTENT = {"PARAMETER": "parameters_bytes", "GRADIENT": "gradients_bytes",
               "OPTIMIZER_STATE": "optimizer_state_bytes", "INPUT": "inputs_bytes"}
_RANGE = "gpukit::forward_backward"


@dataclass(frozen=True)
class MeasuredMemory:
    """Measured memory of real training steps on the CPU, in bytes (compare with a ``MemoryEstimate``).

    Attributes:
        peak_bytes: the most bytes live at once (the model and batch included).
        parameters_bytes, gradients_bytes, optimizer_state_bytes, inputs_bytes: each
            category's largest live total.
        activations_bytes: as the planner defines it: the peak of forward+backward above what
            was live when it began, less the gradients (saved activations, temporaries,
            autocast copies of weights); the largest over the steps.
    """

    peak_bytes: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    inputs_bytes: int
    activations_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_step_memory(
    model: torch.nn.Module,
    example_batch: Any,
    *,
    precision: str = "32-true",
    optimizer: str = "adam",
    steps: int = 2,
    activation_checkpointing: Any = None,
    step_fn: Any = None,
) -> MeasuredMemory:
    """Run ``steps`` real training steps of ``model`` on the CPU and measure their memory.

    Args:
        model: the model, on the CPU; it is converted to ``precision`` and trained in place
            (pass a copy to keep it).
        example_batch: a tensor (``model(x)``), tuple (``model(*x)``) or dict (``model(**x)``).
        precision: a gpukit precision name (weights and autocast as a Session runs them).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` or ``"none"``.
        steps: training steps (2: the optimizer state exists from the first step on).
        activation_checkpointing: a policy as ``Session(activation_checkpointing=...)``.
        step_fn: instead of the loop above, ``step_fn()`` runs one whole step (forward,
            backward, optimizer) -- e.g. of a model set up by a distributed Session -- with its
            forward+backward inside ``with forward_backward():``. Only ``peak_bytes`` and
            ``activations_bytes`` (less no gradients) are filled then: they come from the
            allocator's raw events, since torch's memory profile, which tells the categories,
            builds its data-flow graph on some ranks of an FSDP step and trips on the
            collectives on others.

    Raises:
        ConfigurationError: an unknown optimizer, or a model not on the CPU.
    """
    if optimizer not in OPTIMIZERS:
        raise ConfigurationError(f"measure_step_memory(optimizer={optimizer!r}): use one of {', '.join(OPTIMIZERS)}.")
    cpu = torch.device("cpu")
    own_step = step_fn is None
    if own_step:
        if any(t.device != cpu for t in [*model.parameters(), *model.buffers()]):
            raise ConfigurationError("measure_step_memory measures on the CPU: move the model there first (model.cpu()).")
        chosen = get_precision(precision, get_accelerator("cpu"), cpu)
        model = chosen.convert_module(model)
        opt_cls = OPTIMIZERS[optimizer]
        opt = opt_cls(model.parameters()) if opt_cls is not None else None
        if chosen.param_dtype != torch.float32:
            example_batch = _cast_floats(example_batch, chosen.param_dtype)

        def step_fn() -> None:
            with forward_backward():
                with chosen.autocast():  # backward outside it, as in a Session's loop
                    loss = summed_output(model, example_batch)
                loss.backward()
                del loss
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)

    context = checkpointing_applied(model, activation_checkpointing) if activation_checkpointing else contextlib.nullcontext()
    held = sum(_local_bytes(t) for t in [*model.parameters(), *model.buffers()])
    held += sum(_local_bytes(t) for t in _tensors(example_batch))
    with context:
        return _profile(step_fn, steps, held, categorise=own_step)


def _profile(step_fn: Any, steps: int, held_bytes: int, categorise: bool) -> MeasuredMemory:
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # what earlier steps left in reference cycles is not freed inside the profile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Memory block of unknown size was allocated before..."
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            for _ in range(steps):
                step_fn()
        events, windows = _events(prof, held_bytes, categorise)
    live: dict[str, int] = {}
    largest: dict[str, int] = {}
    total = peak = activations = 0
    window: list[int] | None = None  # [live at its start, peak inside it] of the current step
    for t, name, delta in events:
        inside = any(start <= t <= end for start, end in windows)
        if window is not None and not inside:  # a forward+backward just ended
            activations = max(activations, window[1] - window[0] - live.get("GRADIENT", 0))
            window = None
        if inside and window is None:
            window = [total, total]
        live[name] = live.get(name, 0) + delta
        largest[name] = max(largest.get(name, 0), live[name])
        total += delta
        peak = max(peak, total)
        if window is not None:
            window[1] = max(window[1], total)
    if window is not None:
        activations = max(activations, window[1] - window[0] - live.get("GRADIENT", 0))
    return MeasuredMemory(peak_bytes=peak, activations_bytes=max(0, activations),
                          **{field: largest.get(cat, 0) for cat, field in _PERSISTENT.items()})


def _events(prof: Any, held_bytes: int, categorise: bool = True) -> tuple[list[tuple[int, str, int]], list[tuple[int, int]]]:
    """``(time, category, bytes)`` of every allocation (+) and free (-), and the forward+backward
    windows. Categorised by torch's memory profile when ``categorise`` and it can build its
    data-flow graph; else (a step of the caller's, e.g. under FSDP, or collectives tripping an
    assertion there) from the raw allocator events: every block "OTHER", and what was live
    before the profile counted as ``held_bytes``."""
    from torch.profiler import _memory_profiler as mp

    memory = None
    if categorise:
        try:
            memory = prof._memory_profile()
        except AssertionError:
            pass
    tree = memory._op_tree if memory is not None else mp.OpTree(prof.profiler.kineto_results)
    windows = sorted((n.start_time_ns, n.end_time_ns) for n in tree.sorted_nodes if _name(n) == _RANGE)
    if memory is not None:
        events = []
        for t, action, (key, version), size in memory.timeline:
            if action == mp.Action.INCREMENT_VERSION:
                continue  # a version bump moves no bytes
            category = memory._categories.get(key, version)
            name = category.name if category is not None else "OTHER"
            events.append((t, name, -size if action == mp.Action.DESTROY else size))
        return events, windows
    allocations = [(node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size, _collective_end(node))
                   for node in tree.dfs() if node.typed[0] == mp._EventType.Allocation]
    return replay_by_address(allocations, held_bytes), windows


def _collective_end(node: Any) -> int | None:
    """The end time of the collective (``c10d::...``) an allocation happened in, if any."""
    parent = getattr(node, "parent", None)
    while parent is not None:
        if _name(parent).startswith("c10d::"):
            return int(parent.end_time_ns)
        parent = getattr(parent, "parent", None)
    return None


def replay_by_address(allocations: list[tuple[int, int, int, int | None]], held_bytes: int) -> list[tuple[int, str, int]]:
    """The allocator's own ``(time, address, +bytes / -bytes, end of the enclosing collective or
    None)`` events replayed in time order.

    The profiler records an allocation or free only on threads it follows: a block that a
    collective frees on its backend's thread (gloo drops the copy ``reduce_scatter`` makes of
    its input, and FSDP's collective buffers, on its worker thread) has no free event. Two rules
    put those frees back: a block the allocator hands out at an address still counted live
    proves the block there was freed (it leaves the count then); and a block allocated inside a
    collective that is never seen freed nor replaced leaves the count when that collective's call
    returns -- the earliest it can be gone, so the replay errs low by its lifetime on gloo's
    thread rather than counting it live to the end (which overcounted an FSDP step's peak by 4-10
    MiB, by a different amount each run). A free at an address never allocated in the profile is
    of a block from before it: live from the start, on top of ``held_bytes`` (the model and batch
    the caller counted).
    """
    ordered = sorted(allocations, key=lambda a: a[:3])
    # blocks never seen freed nor replaced: their index, for the collective rule
    last_alloc: dict[int, int] = {}
    for index, (_t, ptr, size, _end) in enumerate(ordered):
        if size > 0:
            last_alloc[ptr] = index
        elif size < 0:
            last_alloc.pop(ptr, None)
    unseen_free = [(ordered[i][3], ordered[i][1], -ordered[i][2]) for i in last_alloc.values()
                   if ordered[i][3] is not None]
    stream = sorted([(t, ptr, size) for t, ptr, size, _end in ordered] + unseen_free)
    events = [(-1, "OTHER", held_bytes)]
    live: dict[int, int] = {}
    unknown = 0
    for t, ptr, size in stream:
        if size > 0:
            if ptr in live:  # its free happened where the profiler did not see it
                events.append((t, "OTHER", -live[ptr]))
            live[ptr] = size
            events.append((t, "OTHER", size))
        elif size < 0:
            if ptr in live:
                events.append((t, "OTHER", -live.pop(ptr)))
            else:  # allocated before the profile
                unknown -= size
                events.append((t, "OTHER", size))
    events[0] = (-1, "OTHER", held_bytes + unknown)
    return events


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    return local.untyped_storage().nbytes()


def _tensors(batch: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]


def _name(node: Any) -> str:
    try:
        return node.name
    except UnicodeDecodeError:  # seen on events of gloo's threads: not ours in any case
        return ""


def forward_backward() -> contextlib.AbstractContextManager[Any]:
    """Mark a step's forward+backward for :func:`measure_step_memory`'s activation figure."""
    from torch.profiler import record_function

    return record_function(_RANGE)


def summed_output(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Call ``model`` on ``batch`` (a dict as keywords, a tuple/list as arguments) and sum the means of every
    floating output (a tensor, tuple, dict or ModelOutput): a loss whose backward reaches every output."""
    output = model(**batch) if isinstance(batch, dict) else (
        model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    return sum(t.float().mean() for t in _float_leaves(output))  # type: ignore[return-value]


def _float_leaves(output: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)
