"""What a run record holds once read: runs per rank file, and runs over all ranks (see :mod:`._read`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RankRecord", "RankRun", "RunInfo", "RunRecord"]


@dataclass
class RankRun:
    """One run's lines in one rank file (from its header to the next header)."""

    meta: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    first_t: float | None = None
    last_t: float | None = None
    resumed_step: int | None = None
    #: the number of processes that saved the checkpoint it resumed (``None``: not said)
    resumed_from_world: int | None = None

    def see(self, t: float) -> None:
        self.first_t = t if self.first_t is None else min(self.first_t, t)
        self.last_t = t if self.last_t is None else max(self.last_t, t)


@dataclass
class RankRecord:
    """What one rank file holds: its runs, and what was skipped while reading it."""

    rank: int
    path: Path
    runs: list[RankRun] = field(default_factory=list)
    skipped_lines: int = 0
    truncated: bool = False
    unread_lines: int = 0  # step / sys lines passed over by sampling (see ._rankfile)
    event_kinds: Counter[str] = field(default_factory=Counter)
    dropped_events: int = 0
    scalar_names: set[str] = field(default_factory=set)
    dropped_scalar_names: int = 0

    @property
    def metas(self) -> list[dict[str, Any]]:
        return [run.meta for run in self.runs if run.meta]

    @property
    def meta(self) -> dict[str, Any]:
        """The latest header (the process writing now, or the last one that did)."""
        metas = self.metas
        return metas[-1] if metas else {}

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [line for run in self.runs for line in run.steps]

    @property
    def samples(self) -> list[dict[str, Any]]:
        return [line for run in self.runs for line in run.samples]

    @property
    def events(self) -> list[dict[str, Any]]:
        return [line for run in self.runs for line in run.events]

    @property
    def ended(self) -> bool:
        return bool(self.runs) and self.runs[-1].ended


@dataclass
class RunInfo:
    """One run of the record, over all ranks.

    Attributes:
        index: 1-based, in the order the runs were written.
        start_t, end_t: its first and last time stamp (unix seconds).
        resumed_step: the checkpoint step it resumed from (``None``: a fresh start).
        restart_count: torchelastic's restart count in its header.
        world_size: processes of the run (its headers'); ``saved_world_size``: of the checkpoint it
            resumed, where the record says (another size: a node lost or added, a requeue elsewhere).
        steps_redone: steps the run before it had recorded after saving the checkpoint this run resumed
            (trained again here); ``None`` where not known.
        finished: every rank that took part wrote its ``end`` line.
        step_offset: added to its step numbers in step plots, so that each run is drawn after the
            runs before it (a process counts its steps from 0) instead of on top of them.
    """

    index: int
    start_t: float
    end_t: float
    resumed_step: int | None
    restart_count: int
    finished: bool
    ranks: int
    step_offset: int = 0
    world_size: int | None = None
    saved_world_size: int | None = None
    steps_redone: int | None = None

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end_t - self.start_t)

    def label(self) -> str:
        how = (f"resumed from step {self.resumed_step:,}" if self.resumed_step is not None
               else f"restart {self.restart_count}" if self.restart_count else "fresh start")
        if self.resumed_step is not None and self.restart_count:
            how += f" after restart {self.restart_count} (a worker or node failed, or nodes changed)"
        if self.saved_world_size is not None and self.world_size is not None \
                and self.saved_world_size != self.world_size:
            how += f"; {self.saved_world_size} -> {self.world_size} processes"
        if self.steps_redone:
            how += f"; {self.steps_redone:,} step(s) redone"
        return f"run {self.index} ({how})"


@dataclass
class RunRecord:
    """A whole record: every rank file's runs, and the runs over all ranks.

    Attributes:
        directory: the record directory.
        ranks: rank -> its record, in rank order.
        runs: the runs, in order (at least one).
        start_t, end_t: first and last time stamp over all ranks (unix seconds).
        notes: what was left out while reading (unreadable files, skipped lines, limits hit).
    """

    directory: Path
    ranks: dict[int, RankRecord]
    runs: list[RunInfo]
    start_t: float
    end_t: float
    notes: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """The last run closed normally on every rank (False while in progress or after a crash)."""
        return self.runs[-1].finished if self.runs else False

    @property
    def duration_s(self) -> float:
        """The time the runs ran, gaps between them left out."""
        return sum(run.duration_s for run in self.runs)

    @property
    def span_s(self) -> float:
        """From the first time stamp to the last, gaps included."""
        return max(0.0, self.end_t - self.start_t)
