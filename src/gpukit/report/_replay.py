"""Replay a run record into TensorBoard event files (what the live forwarding would have written)."""

from __future__ import annotations

import os
from pathlib import Path

from gpukit.monitor import TensorBoardSink
from gpukit.report._read import read_record

__all__ = ["replay_to_tensorboard"]


def replay_to_tensorboard(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[Path]:
    """Write every rank's record as TensorBoard scalars under ``out/rank<R>``.

    Args:
        directory: a run record directory.
        out: TensorBoard log directory (``tensorboard --logdir OUT``).

    Returns:
        The per-rank event directories written.

    Raises:
        ConfigurationError: no readable record, or the ``tensorboard`` package is missing.
    """
    record = read_record(directory)
    written = []
    for rank, rank_record in record.ranks.items():
        sink = TensorBoardSink(Path(out) / f"rank{rank}")
        for k, run in enumerate(rank_record.runs):  # runs one after another, as in the HTML report
            offset = record.runs[k].step_offset
            steps = [{**line, "step": line["step"] + offset} for line in run.steps]
            for line in sorted(steps + run.samples + run.events, key=lambda line: line["t"]):
                sink.write(line)
        sink.close()
        written.append(Path(sink.logdir))
    return written
