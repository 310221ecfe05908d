"""``fit``'s search: the cheapest configurations that fit, planning as few training steps as it can.

A plan (a simulated training step) costs a good part of a second of CPU for a deep model, so the
search plans only what it must:

1. **Ranking needs no plan per configuration.** A step's predicted time depends on its FLOPs
   and on the bytes it moves (parameters, gradients, optimizer state), not on its peak. The
   FLOPs of forward+backward grow with the micro-batch (the compute is per sample) and are the
   same in every precision (the same matmuls), so one plan per checkpointing policy gives every
   configuration's compute (one per tensor-parallel degree as well: a tensor rank is planned as its
   shard of the model). The bytes are the same at every micro-batch and checkpointing policy,
   so one plan per precision gives them; they are needed only where devices talk (DDP, FSDP).
   Every configuration is ranked by the step time predicted from these few *probe* plans.
2. **Cheapest first, each planned exactly** at its own micro-batch, until ``top`` fit. Equal
   predicted times (bf16-true and bf16-mixed compute alike) are planned together and taken in
   the order of their peaks. With ``workers > 1`` the next configurations are planned beside
   them while a worker would be idle.
3. **What cannot fit is passed over unplanned.** A step's tensors grow linearly with the
   micro-batch or not at all, so its peak is convex and rising in the micro-batch: a size is no
   lower than a planned smaller size, nor than the line through two planned sizes beyond it.
   A configuration those bounds put over the budget (by 2%, for the allocator's rounding) is not
   planned, nor is a family (precision, checkpointing, strategy, devices) whose smallest size is
   over it. A family's smallest size is planned before a third plan after two misses (not
   sooner: where the budget is tight the next size down usually fits or is never reached). A
   configuration told from a plan made for another strategy costs nothing.

So a roomy budget costs the probes and the handful of plans printed (7 of them for a 48-layer
transformer on one device, where planning every precision x checkpointing twice took 19); a
tight one about two or three plans per precision x checkpointing. What is returned is planned
exactly, and is what planning every configuration returns
(tests/memory/test_memory_fit_search.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpukit.layout import Layout
from gpukit.memory._fit_costs import Costs, FitOption, option_for
from gpukit.memory._fit_planner import FitPlanner, Key
from gpukit.memory._planner import MemoryEstimate

__all__ = ["Candidate", "Found", "micro_batches", "search"]

#: which precision's plans the probes use when several are ranked: the one the cheapest
#: configurations usually have, so that its probes are plans the search needs anyway
_PROBE_PREFERENCE = ("bf16-true", "bf16-mixed", "32-true")


@dataclass(frozen=True)
class Candidate:
    """One configuration before it is planned."""

    precision: str
    ckpt: str
    layout: Layout
    per_device: int  # samples per device per optimizer step
    micro: int

    @property
    def key(self) -> Key:
        """The plan it needs (what :class:`FitPlanner` caches)."""
        return (self.precision, self.ckpt, self.micro, self.layout.tensor)

    @property
    def family(self) -> tuple[str, str, Layout]:
        return (self.precision, self.ckpt, self.layout)

    @property
    def smallest(self) -> Candidate:
        """Its family's smallest micro-batch."""
        return replace(self, micro=micro_batches(self.per_device)[-1])


def micro_batches(per_device: int) -> list[int]:
    """The micro-batch sizes of ``per_device`` samples, largest first: halved while it divides
    (gradient accumulation makes up the rest)."""
    sizes, size = [per_device], per_device
    while size % 2 == 0:
        size //= 2
        sizes.append(size)
    return sizes


@dataclass(frozen=True)
class Found:
    """What the search found: the configurations that fit (cheapest first), the cheapest one
    left out for memory before them, and, when none fits, the one of least memory."""

    fitting: tuple[FitOption, ...]
    rejected: FitOption | None
    closest: FitOption | None


def search(grid: Sequence[Candidate], planner: FitPlanner, costs: Costs, budget: int, top: int,
           workers: int) -> Found:
    """The ``top`` cheapest configurations of ``grid`` whose exact plan fits ``budget``."""
    ranked = _ranked(grid, planner, costs, workers)
    fitting: list[FitOption] = []
    rejected: FitOption | None = None
    dead: set[tuple[str, str, Layout]] = set()
    misses: Counter[tuple[str, str, str, int]] = Counter()  # plans made that did not fit, by family
    start = 0
    while start < len(ranked) and len(fitting) < top:
        step = ranked[start][0]
        end = start
        while end < len(ranked) and ranked[end][0] == step:
            end += 1
        group = [c for _, c in ranked[start:end] if c.family not in dead]
        for c in group:  # a family that missed twice: does any size fit? (before planning a third)
            if misses[c.family] >= 2 and not planner.planned(c.key) and not planner.planned(c.smallest.key):
                planner.exact(*c.smallest.key)
                _bury(ranked, dead, planner, costs, budget)
        # what the plans so far prove too big is passed over unplanned (but the first one left
        # out is planned: it is reported)
        group = [c for c in group if c.family not in dead and (
            planner.planned(c.key) or (rejected is None and not fitting)
            or _lower_bound(c, planner, costs) <= budget * _MARGIN)]
        new = {c.key for c in group if not planner.planned(c.key)}
        if workers > 1:
            _plan_ahead(group, [c for _, c in ranked[end:]], dead, planner, workers)
        for option, candidate in sorted(((_exact(c, planner, costs), c) for c in group),
                                        key=lambda pair: pair[0].peak_bytes):
            if option.peak_bytes <= budget:
                fitting.append(option)
                if len(fitting) >= top:
                    break
                continue
            if not fitting and rejected is None:
                rejected = option
            misses[candidate.family] += candidate.key in new
            _bury(ranked, dead, planner, costs, budget)
        start = end
    closest = None if fitting else _closest([c for _, c in ranked], planner, costs)
    return Found(tuple(fitting), rejected, closest)


#: a bound decides only where it clears the budget by this much: the allocator's rounding of each
#: tensor (512-byte blocks on CUDA) bends the straight lines of the peak by a little
_MARGIN = 1.02


def _lower_bound(c: Candidate, planner: FitPlanner, costs: Costs) -> float:
    """The least peak ``c`` can have, from its family's sizes planned so far. Every tensor of a
    step grows linearly with the micro-batch (or not at all), so the live bytes at each moment
    do, and the peak -- the most of them -- is convex and rising in the micro-batch: no size is
    below a planned smaller one, nor below the line through two planned sizes beyond them."""
    points = [(m, _exact(replace(c, micro=m), planner, costs).peak_bytes) for m in reversed(micro_batches(c.per_device))
              if planner.planned(replace(c, micro=m).key)]
    bound = max((peak for m, peak in points if m <= c.micro), default=0)
    for (m1, p1), (m2, p2) in zip(points, points[1:]):
        slope = (p2 - p1) / (m2 - m1)
        if c.micro < m1:
            bound = max(bound, p1 - slope * (m1 - c.micro))
        elif c.micro > m2:
            bound = max(bound, p2 + slope * (c.micro - m2))
    return bound


def _closest(ranked: list[Candidate], planner: FitPlanner, costs: Costs) -> FitOption | None:
    """When nothing fits: the cheapest configuration of the least peak. The least peak is at a
    family's smallest micro-batch: those are planned unless bounded above the least one known;
    where the smallest has the least peak, the family's bigger sizes of the same peak (a model
    whose peak is not its activations) are faster, so they are planned too."""
    smallest = list({c.family: c.smallest for c in ranked}.values())
    smallest.sort(key=lambda c: _lower_bound(c, planner, costs))
    least: float | None = None
    for c in smallest:
        if least is None or planner.planned(c.key) or _lower_bound(c, planner, costs) <= least * _MARGIN:
            peak = _exact(c, planner, costs).peak_bytes
            least = peak if least is None else min(least, peak)
    if least is None:
        return None
    for c in ranked:
        while planner.planned(c.key) and c.micro < c.per_device and _exact(c, planner, costs).peak_bytes == least:
            c = replace(c, micro=c.micro * 2)
            planner.exact(*c.key)
    options = [_exact(c, planner, costs) for c in ranked if planner.planned(c.key)]
    return min(options, key=lambda o: o.peak_bytes)


def _bury(ranked: list[tuple[float, Candidate]], dead: set[tuple[str, str, Layout]], planner: FitPlanner,
          costs: Costs, budget: int) -> None:
    """Add to ``dead`` every family whose smallest micro-batch does not fit: planned, or bounded
    above the budget by the plans of its other sizes (the strategies of one precision and
    checkpointing share their plans: one plan can bury them all)."""
    for _, c in ranked:
        low = c.smallest
        if c.family not in dead and (_exact(low, planner, costs).peak_bytes > budget if planner.planned(low.key)
                                     else _lower_bound(low, planner, costs) > budget * _MARGIN):
            dead.add(c.family)


def _ranked(grid: Sequence[Candidate], planner: FitPlanner, costs: Costs,
            workers: int) -> list[tuple[float, Candidate]]:
    """``grid`` as ``[(predicted step time, candidate)]``, cheapest first (ties in grid order),
    predicted from the probe plans (see the module docstring)."""
    if not grid:
        return []
    biggest = max(c.micro for c in grid)
    precisions = sorted({c.precision for c in grid}, key=_PROBE_PREFERENCE.index)
    policies = list(dict.fromkeys(c.ckpt for c in grid))
    degrees = list(dict.fromkeys(c.layout.tensor for c in grid))  # a tensor degree plans its own shard model
    compute = {(ckpt, t): (precisions[0], ckpt, biggest, t) for ckpt in policies for t in degrees}
    talks = any(c.layout.devices > 1 for c in grid)  # bytes matter only where devices exchange them
    moved = {(p, t): compute[(policies[0], t)] if p == precisions[0] or not talks else (p, policies[0], biggest, t)
             for p in precisions for t in degrees}
    planner.plan_all([*compute.values(), *moved.values()], workers)
    per_sample = {what: planner.exact(*key).flops / biggest for what, key in compute.items()}

    def predicted(c: Candidate) -> float:
        tensor = c.layout.tensor
        base: MemoryEstimate = planner.exact(*moved[(c.precision, tensor)])
        estimate = replace(base, flops=per_sample[(c.ckpt, tensor)] * c.micro)
        return option_for(estimate, c.precision, c.ckpt, c.layout, c.micro,
                          c.per_device // c.micro, costs).step_s

    return sorted(((predicted(c), c) for c in grid), key=lambda pair: pair[0])


def _plan_ahead(group: list[Candidate], after: list[Candidate], dead: set[tuple[str, str, Layout]],
                planner: FitPlanner, workers: int) -> None:
    """Plan ``group`` and, while a worker would be idle, the next configurations not planned yet."""
    keys = list(dict.fromkeys(c.key for c in group if not planner.planned(c.key)))
    for c in after:
        if len(keys) >= workers:
            break
        if c.family not in dead and not planner.planned(c.key) and c.key not in keys:
            keys.append(c.key)
    planner.plan_all(keys, workers)


def _exact(c: Candidate, planner: FitPlanner, costs: Costs) -> FitOption:
    """``c`` from the exact plan of its micro-batch."""
    return option_for(planner.exact(*c.key), c.precision, c.ckpt, c.layout, c.micro,
                      c.per_device // c.micro, costs, exact=True)
