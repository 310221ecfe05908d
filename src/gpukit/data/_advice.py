"""The end-of-epoch diagnosis: one line saying where step time went and what to change.

Built from every rank's :class:`~gpukit.data._timing.PassTotals` of the epoch (gathered under
DDP) and the loader's settings. Each cause has one rule and one fix:

* data loading with ``num_workers=0`` -> ``num_workers="auto"`` (the number it would pick);
* workers started afresh each epoch (``persistent_workers=False``), whose first batch carries
  the start-up (``spawn`` re-imports the training script) -> ``persistent_workers=True``;
* data loading with fewer workers than spare cores -> ``num_workers="tune"``; when tuning
  already chose them, the choice is contradicted -> its cache entry is dropped (``"retune"``:
  the next run measures again) -- advice never asks for what is already on;
* data loading with every spare core already working -> a cheaper ``__getitem__``;
* host-to-device copy with ``pin_memory`` off on a GPU -> ``pin_memory=True``;
* host-to-device copy with pinned memory -> smaller batches on the wire;
* an in-memory ``TensorDataset`` on CPUs other work keeps busy -> not the data: the CPU is shared;
* other work on the CPUs and more torch threads than the CPUs it leaves free (torch's default of one
  per core: a one-process CPU run measured ~12x slower so) -> ``torch.set_num_threads(n)``, said
  even when the loader keeps up. Measured over the epoch (:class:`~gpukit._util.cpu.CpuClock`: the
  busy time of this process's CPUs minus its own and its workers').
"""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpukit._util.cpu import CpuClock, CpuShare
from gpukit.data._timing import PassTotals, TimingSummary
from gpukit.accelerators import Accelerator
from gpukit.data._tune_cache import RETUNE_ENV
from gpukit.data._workers import MAX_AUTO_WORKERS, auto_num_workers, usable_cpu_count

__all__ = ["EpochReport", "LoaderFacts", "diagnose", "loader_facts", "cpu_share_now", "ADVICE_SHARE"]

#: a stage taking at least this share of step time gets advice
ADVICE_SHARE = 0.10
#: the first batch of an epoch carrying this share of the epoch's data wait means restarts
_RESTART_SHARE = 0.5
#: a tuned loader waiting this many times longer per batch than tuning measured is re-tuned
_CONTRADICTS = 2.0


@dataclass(frozen=True)
class LoaderFacts:
    """The loader settings the advice depends on."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    start_method: str | None
    pinning_helps: bool
    auto_workers: int  # what num_workers="auto" picks for this dataset and device
    spare_workers: int  # CPUs per process - 1 (at most 8): workers that would not slow the loop
    tuned_by: str | None = None  # where num_workers="tune" took the settings from (None: not tuned)
    tuned_wait_s: float | None = None  # the wait per batch tuning measured for them (None: unknown)
    in_memory: bool = False  # a TensorDataset: indexing costs nothing, a slow batch is not the data's doing


@dataclass(frozen=True)
class EpochReport:
    """One epoch's breakdown over all ranks, with the diagnosis.

    Attributes:
        epoch: the loader's epoch.
        ranks: one :class:`TimingSummary` per rank, in rank order.
        data_share: data wait / step time, mean over ranks.
        h2d_share: copy / step time, mean over ranks (``None``: no copy measured).
        worst_rank: the rank with the largest data share.
        causes: what was found: ``"workers"``, ``"restarts"``, ``"more_workers"``, ``"retune"``,
            ``"dataset"``, ``"shared_cpu"``, ``"pinning"``, ``"copy_size"``, ``"threads"``; empty when
            the loader keeps up on CPUs it does not share.
        line: the one-line diagnosis printed on rank 0.
    """

    epoch: int
    ranks: tuple[TimingSummary, ...]
    data_share: float
    h2d_share: float | None
    worst_rank: int
    causes: tuple[str, ...]
    line: str


def loader_facts(
    loader: Any, accelerator: Accelerator, local_world_size: int, copies: bool, tuned: Any = None,
    pinned: bool | None = None,
) -> LoaderFacts:
    """The :class:`LoaderFacts` of a torch DataLoader (``copies``: batches go to a device;
    ``tuned``: the :class:`~gpukit.data.TuneResult` its settings came from, if any; ``pinned``:
    whether batches are pinned, where not by the DataLoader -- ``None``: its ``pin_memory``)."""
    context = getattr(loader, "multiprocessing_context", None)
    if isinstance(context, str):
        method: str | None = context
    elif context is not None:
        method = context.get_start_method()
    else:  # the platform default, without fixing it as a side effect
        method = multiprocessing.get_start_method(allow_none=True) or (
            multiprocessing.get_all_start_methods()[0]
        )
    per_process = usable_cpu_count() // max(1, local_world_size)
    return LoaderFacts(
        num_workers=int(loader.num_workers), pin_memory=bool(loader.pin_memory if pinned is None else pinned),
        persistent_workers=bool(getattr(loader, "persistent_workers", False)),
        start_method=method, pinning_helps=copies and accelerator.benefits_from_pinned_memory,
        auto_workers=auto_num_workers(loader.dataset, accelerator, local_world_size),
        spare_workers=max(0, min(MAX_AUTO_WORKERS, per_process - 1)),
        tuned_by=None if tuned is None else (
            f"the tuning cache {tuned.cache_path}" if tuned.from_cache else "this run's tuning"),
        tuned_wait_s=1.0 / tuned.batches_per_s if tuned is not None and tuned.batches_per_s else None,
        in_memory=isinstance(loader.dataset, TensorDataset),
    )


_CLOCK = CpuClock()  # from the import (a loader's set-up), then from one epoch's end to the next


def cpu_share_now() -> CpuShare | None:
    """What other work used of this process's CPUs since the last call (the first: since gpukit's data
    layer was imported), with torch's thread count; ``None`` where it cannot be measured."""
    return _CLOCK.share_since(torch.get_num_threads())


def diagnose(per_rank: list[PassTotals], facts: LoaderFacts, cpu: CpuShare | None = None) -> EpochReport:
    """Where the epoch's step time went, and what to change (see the module docstring).

    Args:
        per_rank: Every rank's totals of the pass.
        facts: The loader's settings.
        cpu: How busy other work kept this machine's CPUs over the pass (:func:`cpu_share_now`);
            ``None``: not measured.
    """
    summaries = tuple(t.summary() for t in per_rank)
    n = len(summaries)
    data = sum(s.data_share for s in summaries) / n
    copies = [s.h2d_share for s in summaries if s.h2d_share is not None]
    h2d = sum(copies) / len(copies) if copies else None
    copy = _copy_text(summaries, h2d)
    worst = max(range(n), key=lambda r: summaries[r].data_share)
    samples = sum(s.samples for s in summaries)
    busy_s = max(s.step_time_s for s in summaries)
    steps = max(s.steps for s in summaries)
    head = f"epoch {per_rank[0].epoch + 1}:"  # counted from 1 as the demo and most scripts do (set_epoch: from 0)
    if busy_s > 0:
        head += f" {samples / busy_s:,.0f} samples/s"
        head += f" over {n} ranks" if n > 1 else ""
        head += f", {1e3 * busy_s / max(steps, 1):.1f} ms/step;"
    where = f" (rank {worst} worst: {summaries[worst].data_share:.0%})" if n > 1 else ""
    causes: list[str] = []
    advice: list[str] = []
    if data >= ADVICE_SHARE:
        cause, fix = _data_advice(per_rank[worst], facts, cpu)
        causes.append(cause)
        advice.append(f"data loading is {data:.0%} of step time{where}: {fix}")
    if h2d is not None and h2d >= ADVICE_SHARE:
        if facts.pinning_helps and not facts.pin_memory:
            causes.append("pinning")
            advice.append(f"host-to-device {copy}: pin_memory is off -> pin_memory=True")
        else:
            causes.append("copy_size")
            advice.append(
                f"host-to-device {copy}: batches are large on the wire -> send uint8 or "
                "half tensors and convert on the device, or keep the dataset on the device"
            )
    if not advice:
        advice.append(f"data loading {data:.0%}{where}{', ' + copy if copy else ''}: the loader keeps up")
    elif copy and "pinning" not in causes and "copy_size" not in causes:
        advice.append(copy)  # the copy share is always said where it was measured
    if cpu is not None and cpu.oversubscribed and "shared_cpu" not in causes:
        causes.append("threads")
        advice.append(f"the CPUs are shared ({cpu.describe()}) and torch runs {cpu.threads} threads, more than "
                      f"fit: each waits for the others -> {cpu.thread_fix()}")
    line = f"gpukit: {head} " + "; ".join(advice)
    return EpochReport(per_rank[0].epoch, summaries, data, h2d, worst, tuple(causes), line)


def _copy_text(summaries: tuple[TimingSummary, ...], h2d: float | None) -> str:
    """``copy 12% +-3% (sampled 8 of 120 steps)``: the ranks' mean copy share and its sampling
    error (the ranks' errors combined as independent); "" when no copy was measured."""
    measured = [s for s in summaries if s.h2d_share is not None]
    if h2d is None or not measured:
        return ""
    timed = sum(s.h2d_sampled for s in measured)
    steps = sum(s.steps for s in measured)
    if timed >= steps:
        return f"copy {h2d:.0%}"
    errors = [s.h2d_share_err for s in measured]
    err = "" if None in errors else f" +-{math.sqrt(sum(e * e for e in errors)) / len(errors):.0%}"  # type: ignore[operator]
    return f"copy {h2d:.0%}{err} (sampled {timed} of {steps} steps)"


def _data_advice(totals: PassTotals, facts: LoaderFacts, cpu: CpuShare | None) -> tuple[str, str]:
    workers = facts.num_workers
    if facts.in_memory and cpu is not None and cpu.shared:  # not the data: the CPU it runs on is shared
        fix = (f"{cpu.thread_fix()}, or run when the machine is quieter" if cpu.oversubscribed
               else "run when the machine is quieter")
        return "shared_cpu", (
            f"the dataset is in memory (TensorDataset: indexing it costs nothing), so this is the CPU being "
            f"shared, not the data: {cpu.describe()}"
            + (f" and torch runs {cpu.threads} threads" if cpu.oversubscribed else "") + f" -> {fix}")
    if workers and not facts.persistent_workers and totals.steps > 1 and (
        totals.first_wait_s >= _RESTART_SHARE * totals.wait_s
    ):
        why = (
            "workers re-import the training script at each epoch (spawn)"
            if facts.start_method in ("spawn", "forkserver")
            else "workers restart at each epoch"
        )
        return "restarts", f"{why}: persistent_workers=True"
    if facts.tuned_by is not None:
        wait_s = totals.wait_s / max(1, totals.steps)
        if workers < facts.spare_workers and (
            facts.tuned_wait_s is None or wait_s > _CONTRADICTS * facts.tuned_wait_s
        ):
            measured = (f" ({1e3 * wait_s:.1f} ms per batch; tuning measured {1e3 * facts.tuned_wait_s:.1f})"
                        if facts.tuned_wait_s is not None else "")
            return "retune", (
                f"num_workers={workers} came from {facts.tuned_by}, which this epoch contradicts"
                f"{measured} -> the cached choice is dropped and the next run measures again "
                f"({RETUNE_ENV}=1 forces it)")
        return "dataset", (
            f"num_workers={workers} came from {facts.tuned_by} (measured fastest here) -> make "
            "__getitem__ cheaper (decode once and cache, smaller inputs) or augment on the device")
    if workers == 0:
        if facts.auto_workers:
            return "workers", f'num_workers=0 -> try num_workers="auto" ({facts.auto_workers})'
        if facts.spare_workers:  # "auto" keeps 0 here (the host trains, or a TensorDataset)
            return "workers", f'num_workers=0 -> try num_workers="tune" (up to {facts.spare_workers})'
        return "dataset", (
            "num_workers=0 and no spare core for workers -> make __getitem__ cheaper (decode "
            "once and cache, smaller inputs) or augment on the device"
        )
    if workers < facts.spare_workers:
        return "more_workers", f'num_workers={workers} -> try num_workers="tune"'
    return "dataset", (
        f"num_workers={workers} already uses the spare cores -> make __getitem__ cheaper "
        "(decode once and cache, smaller inputs) or augment on the device"
    )
