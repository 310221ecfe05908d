"""Record lines into TensorBoard: used live by the recorder and by ``gpukit report --tensorboard``.

One mapping for both, so a replayed record looks exactly like a live one:

* ``step`` lines: ``train/<name>`` for each logged scalar, ``time/step_s``, ``time/data_s``,
  ``time/h2d_s``, ``time/compute_s`` and ``throughput/samples_per_s``, at the step number;
* ``sys`` lines: ``system/<field>`` (``system/gpu_util_pct``, ``system/torch_allocated_bytes``...)
  at the sample's index, with its wall time (TensorBoard's "wall" axis lines them up with steps);
* ``event`` lines: text under ``events``.

Writing goes through ``torch.utils.tensorboard.SummaryWriter``, which needs the
``tensorboard`` package (``pip install tensorboard``, or gpukit's ``tensorboard`` extra).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from gpukit.errors import ConfigurationError

__all__ = ["TensorBoardSink", "tensorboard_available", "thin_steps"]

_TIMES = ("step_s", "data_s", "h2d_s", "compute_s")


def _merge(group: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive step lines as one: sums of steps and samples, step-weighted means."""
    if len(group) == 1:
        return group[0]
    total = sum(line.get("n", 1) for line in group)
    merged = {**group[-1], "step": group[0]["step"], "n": total,
              "samples": sum(line.get("samples") or 0 for line in group)}
    for key in _TIMES:
        have = [line for line in group if line.get(key) is not None]
        if have:
            merged[key] = sum(line[key] * line.get("n", 1) for line in have) / sum(line.get("n", 1) for line in have)
    names = {name for line in group for name in line.get("scalars") or {}}
    merged["scalars"] = {}
    for name in names:
        have = [line for line in group if name in (line.get("scalars") or {})]
        merged["scalars"][name] = (sum(line["scalars"][name] * line.get("n", 1) for line in have)
                                   / sum(line.get("n", 1) for line in have))
    return merged


def thin_steps(lines: list[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """``lines`` with their step lines merged into at most ``max_points`` (other lines kept)."""
    steps = [line for line in lines if line.get("type") == "step"]
    if len(steps) <= max_points:
        return lines
    size = -(-len(steps) // max_points)
    merged = [_merge(steps[i:i + size]) for i in range(0, len(steps), size)]
    return [line for line in lines if line.get("type") != "step"] + merged


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package (needed by SummaryWriter) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardSink:
    """Writes record lines (dicts, see :mod:`gpukit.monitor._record`) as TensorBoard scalars.

    Args:
        logdir: the event-file directory (one per rank).

    Raises:
        ConfigurationError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        if not tensorboard_available():
            raise ConfigurationError(
                "Writing TensorBoard files needs the 'tensorboard' package, which is not installed. "
                "Install it (pip install tensorboard) or leave the TensorBoard output out."
            )
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = str(logdir)
        self._writer = SummaryWriter(log_dir=self.logdir, flush_secs=10)
        self._samples = 0

    def write(self, line: dict[str, Any]) -> None:
        """Add one record line's figures (other line types are ignored)."""
        kind, wall = line.get("type"), line.get("t")
        add = self._writer.add_scalar
        if kind == "step":
            step = int(line["step"]) + int(line.get("n", 1)) - 1
            for name, value in (line.get("scalars") or {}).items():
                add(f"train/{name}", value, step, walltime=wall)
            for key in _TIMES:
                if line.get(key) is not None:
                    add(f"time/{key}", line[key], step, walltime=wall)
            busy_s = (line.get("step_s") or 0.0) * line.get("n", 1)
            if busy_s > 0 and line.get("samples"):
                add("throughput/samples_per_s", line["samples"] / busy_s, step, walltime=wall)
        elif kind == "sys":
            for key, value in line.items():
                if key not in ("type", "t") and isinstance(value, (int, float)):
                    add(f"system/{key}", value, self._samples, walltime=wall)
            self._samples += 1
        elif kind == "event":
            details = ", ".join(f"{k}={v}" for k, v in line.items() if k not in ("type", "t", "kind"))
            self._writer.add_text("events", f"{line.get('kind')}: {details}", line.get("step") or 0,
                                  walltime=wall)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
