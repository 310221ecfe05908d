"""What resuming checks before it restores anything: markers, damaged newer steps, world size.

- A step directory is complete when its ``complete.json`` lists every file with its size.
  A newer step that fails that check (a truncated copy, a disk that filled after the rename)
  is not skipped in silence: resuming warns, naming the file and the step it falls back to.
- Another number of processes: state shared by all ranks (models, optimizers, schedulers)
  carries over, and so does a data position saved at an epoch boundary. Per-process state
  saved mid-epoch does not (the remaining batches would be other samples, or a rank would
  have no state at all), so that resume is refused before anything is restored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpukit._util.warnings import warn_at_user_code
from gpukit.checkpoint._formats import MARKER_NAME
from gpukit.errors import CheckpointError

__all__ = ["read_marker", "warn_damaged_newer", "check_world_size"]

_STEP_RE = re.compile(r"^step_(\d+)$")


def read_marker(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(marker, None)`` for a complete step directory, else ``(None, what is wrong)``."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
        files = marker["files"].items()
    except FileNotFoundError:
        return None, f"its {MARKER_NAME} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"its {MARKER_NAME} is unreadable ({type(exc).__name__})"
    for name, size in files:
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return None, f"{name} is missing"
        if actual != size:
            return None, f"{name} has {actual} bytes where {MARKER_NAME} says {size} (truncated or damaged)"
    return dict(marker), None


def warn_damaged_newer(root: Path, chosen: Path | None) -> None:
    """Warn about step directories newer than ``chosen`` that resuming passes over as damaged."""
    chosen_step = int(_STEP_RE.match(chosen.name).group(1)) if chosen is not None else -1  # type: ignore[union-attr]
    try:
        entries = sorted(p for p in root.iterdir() if _STEP_RE.match(p.name) and p.is_dir())
    except OSError:
        return
    for path in entries:
        step = int(_STEP_RE.match(path.name).group(1))  # type: ignore[union-attr]
        if step <= chosen_step:
            continue
        marker, problem = read_marker(path)
        if marker is not None and marker.get("step") == step:
            continue
        fallback = f"resuming from {chosen.name} instead" if chosen is not None else "starting from scratch"
        warn_at_user_code(UserWarning(
            f"Checkpoint {path} is damaged: {problem or 'its step does not match its name'}; {fallback} "
            f"(the steps after it are redone). Delete {path} once you have looked at it."))


def _mid_epoch(state: Any) -> str | None:
    """Why ``state`` is tied to its number of processes, or ``None`` for an epoch-boundary position."""
    if isinstance(state, Mapping) and state.get("batches_consumed") == 0 and "epoch" in state:
        return None
    if isinstance(state, Mapping) and "batches_consumed" in state:
        return f"a data position saved mid-epoch ({state['batches_consumed']} batches into epoch {state.get('epoch')})"
    return "per-process state"


def check_world_size(directory: Path, saved_world: int, world: int, per_rank: Mapping[str, Any],
                     wanted: list[str]) -> None:
    """Refuse a resume under another number of processes unless every per-process state carries over.

    Args:
        directory: the step directory (for messages).
        saved_world, world: processes that saved it, and this run's.
        per_rank: the per-process states read for this rank, by name.
        wanted: the names being resumed.

    Raises:
        CheckpointError: a per-process state would not mean the same under ``world`` processes.
    """
    if saved_world == world:
        return
    tied = {name: why for name in wanted if name in per_rank and (why := _mid_epoch(per_rank[name])) is not None}
    if tied:
        what = "; ".join(f"{name!r} holds {why}" for name, why in tied.items())
        raise CheckpointError(
            f"{directory} was saved by {saved_world} process(es) and this run has {world}: {what}, which does "
            f"not carry over to another number of processes. Resume with {saved_world} process(es) "
            f"(e.g. gpukit run --nproc {saved_world} ...), or start from another checkpoint directory (or delete "
            f"{directory.parent}). A checkpoint saved at an epoch boundary resumes under any number of processes."
        )
    warn_at_user_code(UserWarning(
        f"{directory} was saved by {saved_world} process(es), resuming with {world}: it was saved at an epoch "
        "boundary, so models, optimizers and the epoch carry over; ranks without RNG state of their own use "
        "rank 0's."))
