"""Plan a model of N identical blocks from two short copies of it: the planner's speed-up.

A transformer's layers are the same module N times over, and every figure of a training step
grows with N in a straight line: parameters, gradients, optimizer state and FLOPs per block,
and the live memory at any point of the step -- block i's forward starts with the activations
of the i blocks before it kept, its backward with the gradients of those after it made. So
:func:`estimate_memory` simulates the model with the run of N blocks cut to ``2u + r`` and to
``3u + r`` blocks (``u``: blocks per repeating unit, 2 when every other block is checkpointed;
``r = N mod u``) and extends every figure to N.

The peak is the one figure that is no straight line: it is the highest of several, each of
which is -- the forward of the first, a middle and the last unit, the head, the backward of each
of them, the optimizer step. They cross as N grows (a large vocabulary's head at few layers,
the last block's backward at many), so each is extended on its own: the simulation is cut
into segments at every unit's forward and backward (a module hook and a tensor hook), the
live bytes at each start and the peak of each segment recorded, and the middle units -- whose
peak moves with their position -- taken at both ends of the run (see :func:`extend`). The
result is exact whenever the blocks are alike; ``tests/memory/test_memory_planner_repeat.py``
compares it with simulating every block.

Blocks count as alike when they have the same class, parameter and buffer shapes, module
tree (``repr``) and plain attributes, apart from integer position attributes (``layer_idx``).
Anything unexpected -- blocks called out of order or twice, no gradient to hook, a model that
fails with fewer blocks -- makes the planner simulate every block instead.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gpukit.memory._activation import check_policy, checkpoint_targets
from gpukit.memory._blocks import find_blocks

__all__ = ["RepeatedRun", "find_run", "reduced", "SegmentMarks", "extend"]

#: runs shorter than this are simulated whole (two copies of 2 and 3 units would save little)
MIN_UNITS = 6
_POSITION_ATTR = re.compile(r"(^|_)(idx|index|id|number|num)$")
_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class RepeatedRun:
    """``blocks``, consecutive children ``keys`` of ``parent``, alike (see the module docstring)."""

    parent: nn.Module
    keys: tuple[str, ...]
    blocks: tuple[nn.Module, ...]
    unit: int
    remainder: int

    @property
    def units(self) -> int:
        return (len(self.blocks) - self.remainder) // self.unit

    def depth(self, units: int) -> int:
        """Blocks in a copy of ``units`` units (the remainder stays with the last unit)."""
        return units * self.unit + self.remainder


def _plain_attributes(module: nn.Module) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, _SIMPLE) or callable(value) or isinstance(value, (tuple, list)):
            out[name] = value
        else:
            out[name] = ("object", id(value))  # a shared config object: the same one, or different
    return out


def _signature(block: nn.Module) -> tuple[Any, ...]:
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                    for n, t in [*block.named_parameters(), *block.named_buffers()])
    return type(block), repr(block), tensors


def _alike(blocks: list[nn.Module]) -> bool:
    first = blocks[0]
    if any(_signature(b) != _signature(first) for b in blocks[1:]):
        return False
    named = [dict(b.named_modules()) for b in blocks]
    for name, module in named[0].items():
        attributes = [_plain_attributes(n[name]) for n in named]
        for key, value in attributes[0].items():
            values = [a.get(key) for a in attributes]
            if all(v == value for v in values):
                continue
            positions = isinstance(value, int) and _POSITION_ATTR.search(key) is not None
            if not positions or values != [value + i for i in range(len(values))]:
                return False
    return True


def _runs(model: nn.Module) -> list[tuple[nn.Module, list[str], list[nn.Module]]]:
    """Runs of consecutive alike blocks (gpukit's blocks: transformer layers, stacks) per container."""
    parents = dict(model.named_modules())
    by_parent: dict[int, tuple[nn.Module, list[tuple[str, nn.Module]]]] = {}
    for name, block in find_blocks(model):
        parent_name, _, key = name.rpartition(".")
        parent = parents.get(parent_name) if parent_name else model
        if parent is None or not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        by_parent.setdefault(id(parent), (parent, []))[1].append((key, block))
    runs = []
    for parent, found in by_parent.values():
        order = list(parent._modules)
        current: list[tuple[str, nn.Module]] = []
        for key, block in sorted(found, key=lambda item: order.index(item[0])):
            if current and order.index(key) == order.index(current[-1][0]) + 1 and \
                    _signature(block) == _signature(current[0][1]):  # the whole run is checked by find_run
                current.append((key, block))
                continue
            if len(current) > 1:
                runs.append((parent, [k for k, _ in current], [b for _, b in current]))
            current = [(key, block)]
        if len(current) > 1:
            runs.append((parent, [k for k, _ in current], [b for _, b in current]))
    return runs


def _pattern(model: nn.Module, blocks: list[nn.Module], checkpointing: Any) -> list[frozenset[str]] | None:
    """Per block, what the policy checkpoints in it (relative names; "" is the block itself)."""
    targets = {id(m) for _, m in checkpoint_targets(model, checkpointing)} if checkpointing is not None else set()
    return [frozenset(n for n, m in b.named_modules() if id(m) in targets) for b in blocks]


def find_run(model: nn.Module, checkpointing: Any) -> RepeatedRun | None:
    """The longest run of alike blocks worth planning from short copies, or ``None``."""
    checkpointing = check_policy(checkpointing)
    best: RepeatedRun | None = None
    for parent, keys, blocks in _runs(model):
        if not _alike(blocks):
            continue
        pattern = _pattern(model, blocks, checkpointing)
        unit = next((u for u in (1, 2) if all(pattern[i] == pattern[i - u] for i in range(u, len(blocks)))), None)
        if unit is None:
            continue
        run = RepeatedRun(parent, tuple(keys), tuple(blocks), unit, len(blocks) % unit)
        if run.units >= MIN_UNITS and (best is None or len(run.blocks) > len(best.blocks)):
            best = run
    return best


@contextlib.contextmanager
def reduced(model: nn.Module, run: RepeatedRun, units: int, checkpointing: Any,
            targets: list[tuple[str, nn.Module]] | None = None) -> Iterator[tuple[list[nn.Module], Any]]:
    """The model with its run cut to ``units`` units, for the ``with`` body (put back afterwards).

    Yields the blocks kept and the checkpointing policy for the cut model: the modules the
    policy chose in the whole model (by identity; ``targets``: ``checkpoint_targets`` of the
    whole model, when known), so each kept block keeps its status.
    """
    depth = run.depth(units)
    kept_blocks = list(run.blocks[:depth - run.remainder - run.unit]) + list(run.blocks[-(run.unit + run.remainder):])
    if targets is None:
        targets = checkpoint_targets(model, checkpointing) if check_policy(checkpointing) else []
    chosen = {id(m) for _, m in targets}
    policy = (lambda module, name: id(module) in chosen) if chosen else None  # noqa: E731
    modules = run.parent._modules
    original = list(modules.items())
    first = [key for key, _ in original].index(run.keys[0])
    kept = original[:first] + [(run.keys[i], b) for i, b in enumerate(kept_blocks)] + original[first + len(run.blocks):]
    if all(key.isdigit() for key, _ in original):  # ModuleList/Sequential index by position
        kept = [(str(i), module) for i, (_, module) in enumerate(kept)]
    modules.clear()
    modules.update(OrderedDict(kept))
    try:
        yield kept_blocks, policy
    finally:
        modules.clear()
        modules.update(OrderedDict(original))


class SegmentMarks:
    """Marks the start of every unit's forward and backward in a simulated step (see the docstring)."""

    def __init__(self, blocks: list[nn.Module], unit: int, mark: Callable[[tuple[Any, ...]], None]) -> None:
        self.mark = mark
        count = (len(blocks) - len(blocks) % unit) // unit
        starts = [blocks[j * unit] for j in range(count)]
        ends = [blocks[(j + 1) * unit - 1] if j < count - 1 else blocks[-1] for j in range(count)]
        self.handles = [b.register_forward_pre_hook(self._forward(j)) for j, b in enumerate(starts)]
        self.handles += [b.register_forward_hook(self._backward(j)) for j, b in enumerate(ends)]
        self.failed = False

    def _forward(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():
                self.mark(("F", j))
        return hook

    def _backward(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            grads = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not grads:
                self.failed = True
                return
            grads[0].register_hook(lambda grad: self.mark(("B", j)))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def segments(marks: list[tuple[tuple[Any, ...], int, int]], units: int) -> dict[str, dict[Any, int]] | None:
    """Per segment (keyed by the mark that opened it): the live bytes at its start and its peak;
    ``None`` unless the marks came in the order of one forward and one backward through ``units`` units."""
    expected = ([("S",)] + [("F", j) for j in range(units)] + [("B", j) for j in reversed(range(units))]
                + [("E",), ("O",)])
    if [label for label, _, _ in marks] != expected:
        return None
    return {"start": {label: live for label, live, _ in marks},
            "peak": {label: peak for (label, _, _), (_, _, peak) in zip(marks, marks[1:])}}


def extend(short: dict[str, Any], long: dict[str, Any], k: int, n: int) -> dict[str, Any]:
    """Figures at ``n`` units from those of the copies of ``k`` (``short``) and ``k + 1``
    (``long``) units; ``k + 1 >= 3``, so the long copy has a middle unit.

    Scalars, and the peaks of the segments that are no middle unit's (before the blocks, the
    first and the last unit's forward and backward, the optimizer step), grow by their
    difference per unit. A middle unit ``j``'s peak is what is live when it starts plus what it
    adds, the same for every middle unit (measured on unit 1 of the long copy): its forward
    starts with ``j - 1`` more units' activations than unit 1's (causal: whatever follows), its
    backward with ``j`` more units' net change than unit 0's backward, which starts with what
    every unit after it left. Both grow with ``j``, so the highest is at ``j = 1`` or ``n - 2``.
    """
    def line(a: int, b: int) -> int:
        return a + (b - a) * (n - k)

    out = {key: line(short[key], long[key]) for key in short if key != "segments"}
    short_start, short_peak = short["segments"]["start"], short["segments"]["peak"]
    start, peak = long["segments"]["start"], long["segments"]["peak"]
    edges = [("S",), ("F", 0), ("B", 0)]
    peaks = [line(short_peak[label], peak[label]) for label in edges]
    peaks += [line(short_peak[(kind, k - 1)], peak[(kind, k)]) for kind in ("F", "B")]  # the last unit
    forward_step = start[("F", 2)] - start[("F", 1)]  # one middle unit's activations kept
    backward_step = start[("B", 1)] - start[("B", 0)]  # one middle unit's backward, net
    backward_zero = line(short_start[("B", 0)], start[("B", 0)])
    for j in (1, n - 2):
        peaks.append(start[("F", 1)] + (j - 1) * forward_step + peak[("F", 1)] - start[("F", 1)])
        peaks.append(backward_zero + j * backward_step + peak[("B", 1)] - start[("B", 1)])
    out["fwd_bwd_peak_abs"] = max(peaks)
    out["opt_peak"] = line(short_peak[("E",)], peak[("E",)])
    return out
