"""Read a run record directory (format: :mod:`gpukit.monitor._record`), finished or still running.

Each ``rank<R>.jsonl`` is read up to its last complete line: a torn last line (the run is
writing, or was killed mid-line) and lines that are not JSON objects are skipped and counted,
never fatal. A file written by a newer record version is refused with a clear error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpukit.errors import ConfigurationError
from gpukit.monitor._record import RECORD_FORMAT, RECORD_VERSION

__all__ = ["RankRecord", "RunRecord", "read_record"]

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")


@dataclass
class RankRecord:
    """What one rank wrote: header lines (one per process that wrote), steps, samples, events."""

    rank: int
    path: Path
    metas: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False
    skipped_lines: int = 0

    @property
    def meta(self) -> dict[str, Any]:
        """The latest header (the process writing now, or the last one that did)."""
        return self.metas[-1] if self.metas else {}

    def times(self) -> list[float]:
        return [line["t"] for group in (self.metas, self.steps, self.samples, self.events)
                for line in group if isinstance(line.get("t"), (int, float))]


@dataclass
class RunRecord:
    """A whole record: every rank's file.

    Attributes:
        directory: the record directory.
        ranks: rank -> its record, in rank order.
        start_t, end_t: first and last time stamp over all ranks (unix seconds).
        finished: every rank wrote its ``end`` line (False while the run is in progress or
            after a crash).
    """

    directory: Path
    ranks: dict[int, RankRecord]
    start_t: float
    end_t: float

    @property
    def finished(self) -> bool:
        return all(r.ended for r in self.ranks.values())

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end_t - self.start_t)


def _read_rank(rank: int, path: Path) -> RankRecord:
    record = RankRecord(rank=rank, path=path)
    with open(path, encoding="utf-8", errors="replace") as handle:
        for text in handle:
            try:
                line = json.loads(text)
            except ValueError:  # torn last line, or garbage: skip, keep going
                record.skipped_lines += 1
                continue
            if not isinstance(line, dict):
                record.skipped_lines += 1
                continue
            kind = line.get("type")
            if kind == "meta":
                if line.get("format") != RECORD_FORMAT:
                    raise ConfigurationError(f"{path} is not a gpukit run record (header format "
                                             f"{line.get('format')!r}, expected {RECORD_FORMAT!r}).")
                if int(line.get("version", 0)) > RECORD_VERSION:
                    raise ConfigurationError(
                        f"{path} was written by a newer gpukit (record version {line.get('version')}; "
                        f"this one reads up to {RECORD_VERSION}). Upgrade gpukit to read it.")
                record.metas.append(line)
                record.ended = False
            elif kind == "step" and isinstance(line.get("step"), int):
                record.steps.append(line)
            elif kind == "sys":
                record.samples.append(line)
            elif kind == "event":
                record.events.append(line)
            elif kind == "end":
                record.ended = True
    return record


def read_record(directory: str | os.PathLike[str]) -> RunRecord:
    """Read every rank's file of a record directory.

    Args:
        directory: what ``Session(record=...)`` or ``gpukit run --record`` was given.

    Returns:
        A :class:`RunRecord` (works on a run still in progress: up to each file's last line).

    Raises:
        ConfigurationError: the directory does not exist or holds no ``rank<N>.jsonl`` file,
            or a file is not a gpukit record.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ConfigurationError(
            f"No run record at {str(directory)!r}: not a directory. Give the directory passed to "
            "Session(record=...) or `gpukit run --record DIR`.")
    files = sorted(((int(m.group(1)), p) for p in path.iterdir() if (m := _RANK_FILE.match(p.name))),
                   key=lambda item: item[0])
    if not files:
        raise ConfigurationError(
            f"{str(directory)!r} holds no run record (no rank<N>.jsonl files). Record a run with "
            "Session(record=DIR) or `gpukit run --record DIR script.py` first.")
    ranks = {rank: _read_rank(rank, file) for rank, file in files}
    times = [t for r in ranks.values() for t in r.times()]
    if not times:
        raise ConfigurationError(f"The run record in {str(directory)!r} is empty (no complete line yet).")
    return RunRecord(directory=path, ranks=ranks, start_t=min(times), end_t=max(times))
