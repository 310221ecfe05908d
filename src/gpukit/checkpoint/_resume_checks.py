"""What resuming checks before it restores anything: markers, damaged newer steps, world size.

- A step directory is complete when its ``complete.json`` lists every file with its size.
  A newer step that fails that check (a truncated copy, a disk that filled after the rename)
  is not skipped in silence: resuming warns, naming the file and the step it falls back to.
- Another number of processes: state shared by all ranks (models, optimizers, schedulers)
  carries over, and so does a gpukit loader's data position (samples of the epoch's global order,
  re-cut over the new ranks -- or the older per-rank form, which it converts) and any position saved
  at an epoch boundary. Other per-process state does not (a loader of the user's own counting its
  batches, a name saved ``per_rank``), so that resume is refused before anything is restored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from gpukit._util.warnings import warn_at_user_code
from gpukit.checkpoint._formats import MARKER_NAME
from gpukit.checkpoint._untrusted import is_plain_name, read_json, regular_file_size
from gpukit.errors import CheckpointError

__all__ = ["read_marker", "warn_damaged_newer", "warn_unusable", "open_newest", "check_step_files", "check_world_size"]

T = TypeVar("T")
_STEP_RE = re.compile(r"^step_(\d+)$")


_MAX_WORLD_SIZE = 1 << 20


def _marker_problem(marker: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a parsed complete.json, or ``None``."""
    def count(value: Any, low: int, high: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    if not count(marker.get("step"), 0, 2**63):
        return f"its step is {str(marker.get('step'))[:40]!r}, not a whole number"
    if not count(marker.get("world_size"), 1, _MAX_WORLD_SIZE):
        return f"its world_size is {str(marker.get('world_size'))[:40]!r}, not a number of processes"
    files = marker.get("files")
    if not isinstance(files, dict) or len(files) > 4 * _MAX_WORLD_SIZE:
        return "its file list is not a mapping of names to sizes"
    for name, size in files.items():
        if not is_plain_name(name) or name == MARKER_NAME:
            return f"it lists {str(name)[:80]!r}, which is no file of the step directory"
        if not count(size, 0, 2**63):
            return f"it gives {name} the size {str(size)[:40]!r}"
    return None


def read_marker(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(marker, None)`` for a complete step directory, else ``(None, what is wrong)``.

    ``complete.json`` is read as untrusted (regular file, bounded size and nesting, checked
    field types), and every file it lists must be a regular file of the size it gives.
    """
    if not path.is_dir():
        return None, "it is not a directory (a file, a dangling symlink or a symlink loop)"
    marker_path = path / MARKER_NAME
    if not os.path.lexists(marker_path):
        return None, f"its {MARKER_NAME} is missing"
    try:
        marker = read_json(marker_path, MARKER_NAME)
    except CheckpointError as exc:
        return None, f"its {MARKER_NAME} is unreadable ({str(exc).removeprefix(MARKER_NAME + ' ')})"
    problem = _marker_problem(marker)
    if problem is not None:
        return None, f"its {MARKER_NAME} is wrong: {problem}"
    for name, size in marker["files"].items():
        try:
            actual = regular_file_size(path / name, name)
        except CheckpointError as exc:
            return None, str(exc) if os.path.lexists(path / name) else f"{name} is missing"
        if actual != size:
            return None, f"{name} has {actual} bytes where {MARKER_NAME} says {size} (truncated or damaged)"
    return dict(marker), None


def warn_unusable(path: Path, problem: str, fallback: Path | None) -> None:
    """Warn that resuming passes over the step directory ``path`` (and what it does instead)."""
    instead = f"resuming from {fallback.name} instead" if fallback is not None else "starting from scratch"
    warn_at_user_code(UserWarning(
        f"Checkpoint {path} is damaged: {problem.rstrip('.')}; {instead} (the steps after it are redone). "
        f"Delete {path} once you have looked at it."))


def warn_damaged_newer(root: Path, chosen: Path | None) -> None:
    """Warn about step directories newer than ``chosen`` that resuming passes over as damaged."""
    chosen_step = int(_STEP_RE.match(chosen.name).group(1)) if chosen is not None else -1  # type: ignore[union-attr]
    try:
        entries = sorted(p for p in root.iterdir() if _STEP_RE.match(p.name) and (p.is_dir() or p.is_symlink()))
    except OSError:
        return
    for path in entries:
        step = int(_STEP_RE.match(path.name).group(1))  # type: ignore[union-attr]
        if step <= chosen_step:
            continue
        marker, problem = read_marker(path)
        if marker is not None and marker.get("step") == step:
            continue
        warn_unusable(path, problem or "its step does not match its name", chosen)


def open_newest(root: Path, candidates: list[Path], dist: Any, open_step: Callable[[Path], T]) -> tuple[Path, T] | None:
    """The newest of ``candidates`` (complete steps, oldest first) that every rank can open.

    Each step is tried newest first with ``open_step`` (which raises CheckpointError for
    anything wrong); the ranks agree on each verdict (``dist.gather_all``), so all of them pass
    over a step that one cannot open. Rank 0 warns for each step passed over.

    Returns:
        ``(step directory, what open_step returned)``, or ``None`` when there is no complete step.

    Raises:
        CheckpointError: complete steps exist but none can be opened (each one and why).
    """
    warn_damaged_newer(root, candidates[-1] if candidates else None)
    passed: list[str] = []
    for index in range(len(candidates) - 1, -1, -1):
        directory = candidates[index]
        try:
            opened, problem = open_step(directory), None
        except CheckpointError as exc:
            opened, problem = None, str(exc)
        problems = [p for p in dist.gather_all(problem) if p]  # all ranks pass over it, or none
        if not problems:
            return directory, opened  # type: ignore[return-value]
        if opened is not None and hasattr(opened[1], "close"):  # this rank could open it, another could not
            opened[1].close()
        passed.append(f"{directory.name}: {problems[0]}")
        if dist.is_main and index > 0:
            warn_unusable(directory, problems[0], candidates[index - 1])
    if passed:
        raise CheckpointError(f"No checkpoint in {root} can be resumed: {' | '.join(passed)} "
                              "Copy the checkpoints again, or move them away to start from scratch.")
    return None


def check_step_files(directory: Path, shared: Any, per_rank: Any) -> None:
    """Refuse step files that loaded but are not what CheckpointManager writes."""
    if not (isinstance(shared, Mapping) and isinstance(shared.get("objects"), Mapping)
            and isinstance(shared.get("gpukit"), Mapping)):
        raise CheckpointError(f"{directory / 'state.pt'} is not a gpukit step file (no objects and gpukit entries).")
    if not (isinstance(per_rank, Mapping) and isinstance(per_rank.get("objects"), Mapping) and "rng" in per_rank):
        raise CheckpointError(f"The per-process file in {directory} is not a gpukit step file (no objects and rng).")


def _mid_epoch(state: Any) -> str | None:
    """Why ``state`` is tied to its number of processes, or ``None`` for a position that carries over."""
    if isinstance(state, Mapping) and state.get("batches_consumed") == 0 and "epoch" in state:
        return None
    if isinstance(state, Mapping) and "epoch" in state and (
            "samples_consumed" in state or ("world_size" in state and "batch_size" in state)):
        return None  # a gpukit loader's: samples of the epoch's order (the loader refuses what it cannot re-cut)
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
        f"{directory} was saved by {saved_world} process(es), resuming with {world}: models, optimizers and "
        "schedulers carry over (sharded state is resharded), a gpukit loader's position is cut over the new "
        "ranks (every sample not yet seen this epoch is seen once), and random streams continue the saved one where "
        "every rank shared it, else are re-derived per rank."))
