"""Read a run record directory (format: :mod:`gpukit.monitor._record`), finished or still running.

A record holds *runs*: every process that writes a rank file starts with a ``meta`` line, so
the k-th header of each rank file opens run k (a second ``--record`` run into the same
directory, an elastic restart, a resumed run). A run that restored a checkpoint (its
``checkpoint`` event has ``resumed_step``) is marked resumed.

The record is untrusted input and is read within fixed bounds (see :mod:`._files` and
:mod:`._lines`): regular files only, lines up to 64 KiB, at most 1,024 rank files and 512 MiB
in all, checked fields. Lines that cannot be used (torn, not JSON, bad values) are skipped and
counted; what was left out is listed in :attr:`RunRecord.notes`. Time and memory stay bounded
whatever the record holds: past a budget of lines per rank, step and system lines are sampled
(see :mod:`._rankfile`). A file of another format or a newer record version is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpukit.errors import ConfigurationError
from gpukit.report._files import file_budget, list_rank_files, open_regular
from gpukit.report._lines import short
from gpukit.report._rankfile import PARSE_BUDGET, read_rank
from gpukit.report._records import RankRecord, RankRun, RunInfo, RunRecord

__all__ = ["RankRecord", "RankRun", "RunInfo", "RunRecord", "read_record"]


def _runs(ranks: dict[int, RankRecord]) -> list[RunInfo]:
    count = max((len(r.runs) for r in ranks.values()), default=0)
    runs: list[RunInfo] = []
    plotted_max: float | None = None
    for k in range(count):
        parts = [r.runs[k] for r in ranks.values() if len(r.runs) > k]  # every run has a line: first_t is set
        resumed = next((p.resumed_step for p in parts if p.resumed_step is not None), None)
        restarts = max((p.meta.get("restart_count") or 0 for p in parts), default=0)
        info = RunInfo(index=len(runs) + 1, start_t=min(p.first_t for p in parts),  # type: ignore[type-var]
                       end_t=max(p.last_t for p in parts), resumed_step=resumed,  # type: ignore[type-var]
                       restart_count=restarts, finished=all(p.ended for p in parts), ranks=len(parts))
        first = min((p.steps[0]["step"] for p in parts if p.steps), default=None)
        last = max((p.steps[-1]["step"] + p.steps[-1]["n"] for p in parts if p.steps), default=None)
        if first is not None and plotted_max is not None:  # drawn after the runs before it, never on top
            info.step_offset = max(0, int(plotted_max) - first)  # plotted_max: one past the last step
        if last is not None:
            end = last + info.step_offset
            plotted_max = end if plotted_max is None else max(plotted_max, end)
        worlds = [w for p in parts if isinstance(w := p.meta.get("world_size"), int)]
        info.world_size = max(worlds) if worlds else None
        info.saved_world_size = next((p.resumed_from_world for p in parts if p.resumed_from_world), None)
        if resumed is not None and k > 0:
            info.steps_redone = _steps_after_save([r.runs[k - 1] for r in ranks.values() if len(r.runs) >= k], resumed)
        runs.append(info)
    return runs


def _steps_after_save(before: list[RankRun], saved_step: int) -> int | None:
    """Steps the run ``before`` recorded after it saved ``saved_step`` (the most any rank did); ``None``
    when its record does not show that save.

    The save's event carries the record's step count at that moment, which does not yet include the
    step that ended just before the save (a step's line is written when the next one begins): so the
    steps after the save are those recorded beyond that count, less that one.
    """
    redone = None
    for part in before:
        counts = [e["step"] for e in part.events if e.get("kind") == "checkpoint"
                  and e.get("saved_step") == saved_step and isinstance(e.get("step"), int)]
        if counts and part.steps:
            end = max(int(s["step"]) + int(s.get("n") or 1) for s in part.steps)  # one past the last step
            after = max(0, end - (max(counts) + 1) - 1)
            redone = after if redone is None else max(redone, after)
    return redone


def read_record(directory: str | os.PathLike[str]) -> RunRecord:
    """Read every rank's file of a record directory.

    Args:
        directory: what ``Session(record=...)`` or ``gpukit run --record`` was given.

    Returns:
        A :class:`RunRecord` (works on a run still in progress: up to each file's last line).

    Raises:
        ConfigurationError: the directory does not exist or holds no readable ``rank<N>.jsonl``
            file, or a file is not a gpukit record (or is of a newer record version).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ConfigurationError(
            f"No run record at {str(directory)!r}: not a directory. Give the directory passed to "
            "Session(record=...) or `gpukit run --record DIR`.")
    try:
        listing = list_rank_files(path)
    except OSError as exc:
        raise ConfigurationError(f"Cannot list the run record {str(directory)!r}: {exc.strerror or exc}.") from None
    if not listing.files:
        raise ConfigurationError(
            f"{str(directory)!r} holds no run record (no rank<N>.jsonl files). Record a run with "
            "Session(record=DIR) or `gpukit run --record DIR script.py` first.")
    notes = []
    if listing.found > len(listing.files):
        notes.append(f"{listing.found:,} rank files: only the {len(listing.files):,} lowest ranks were read")
    max_bytes = file_budget(len(listing.files))
    max_lines = max(500, PARSE_BUDGET // len(listing.files))
    ranks: dict[int, RankRecord] = {}
    unreadable = []
    for rank, file in listing.files:
        fd, why = open_regular(file)
        if fd is None:
            unreadable.append(f"{short(file.name)}: {why}")
            continue
        ranks[rank], rank_notes = read_rank(rank, file, fd, max_bytes, max_lines)
        notes.extend(rank_notes)
    if unreadable:
        shown = unreadable[:10] + ([f"... and {len(unreadable) - 10:,} more"] if len(unreadable) > 10 else [])
        notes.insert(0, "rank files not read: " + "; ".join(shown))
    runs = _runs(ranks)
    if not runs:
        reason = (" (" + "; ".join(unreadable[:3]) + ")") if unreadable else ""
        raise ConfigurationError(f"The run record in {str(directory)!r} has no readable line yet{reason}.")
    return RunRecord(directory=path, ranks=ranks, runs=runs, start_t=min(r.start_t for r in runs),
                     end_t=max(r.end_t for r in runs), notes=notes)
