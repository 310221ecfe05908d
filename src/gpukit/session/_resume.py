"""What ``session.resume`` did: the step, the directory, the saved extras and the data position.

``session.resume`` returns the step (as it always did) and keeps a :class:`ResumeInfo` in
``session.resumed``: ``extra`` holds what ``save_checkpoint(extra={...})`` saved (nanoGPT's
``best_val_loss``). Rank 0 prints one line either way, so a run never resumes silently from a
checkpoint its user thought deleted::

    gpukit: resumed from ckpt/step_00000033 (step 33; loader at epoch 1, batch 12)
    gpukit: no checkpoint in ckpt yet; starting from the beginning
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ResumeInfo", "resume_line"]


@dataclass(frozen=True)
class ResumeInfo:
    """One resume (``session.resumed``)."""

    #: the step resumed from
    step: int
    #: the step directory read
    path: Path
    #: the ``extra`` values saved with it
    extra: dict[str, Any] = field(default_factory=dict)
    #: the data loader's position: its epoch and the batches of it already done (``None``: no loader given)
    epoch: int | None = None
    batch: int | None = None


def loader_position(objects: dict[str, Any]) -> tuple[int | None, int | None]:
    """(epoch, batches consumed) of the first gpukit loader among ``objects``."""
    for obj in objects.values():
        if hasattr(obj, "batches_consumed") and hasattr(obj, "epoch"):
            return int(obj.epoch), int(obj.batches_consumed)
    return None, None


def resume_line(info: ResumeInfo | None, directory: Any) -> str:
    """The line rank 0 prints after a resume (or after finding nothing to resume)."""
    if info is None:
        return f"gpukit: no checkpoint in {directory} yet; starting from the beginning"
    where = f"; loader at epoch {info.epoch}, batch {info.batch}" if info.epoch is not None else ""
    return f"gpukit: resumed from {info.path} (step {info.step}{where})"
