"""Reading one step directory back: its files opened and checked before use (:func:`open_step`), then
the saved state put into the caller's objects (:func:`restore_objects`); the names of a step's files.
:class:`~gpukit.checkpoint._manager.CheckpointManager` chooses the step and saves.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from torch import nn

from gpukit.checkpoint._ddp_buckets import check_ddp_buckets, replay_ddp_buckets
from gpukit.checkpoint._dist import DistContext
from gpukit.checkpoint._io import load
from gpukit.checkpoint._lazy import LazyCheckpoint
from gpukit.checkpoint._prefixes import match_state_dict
from gpukit.checkpoint._read import load_lazy
from gpukit.checkpoint._resume_checks import check_step_files, check_world_size, read_marker
from gpukit.checkpoint._sharded import is_sharded_checkpoint, read_metadata, restore_sharded
from gpukit.errors import CheckpointError

__all__ = ["SHARED_FILE", "open_step", "rank_file_name", "restore_objects"]

SHARED_FILE = "state.pt"


def rank_file_name(rank: int) -> str:
    """Name of the per-rank file of ``rank`` inside a step directory."""
    return f"rank_{rank:05d}.pt"


def restore_objects(
    directory: Path, dist: DistContext, saved_world: int, shared_file: LazyCheckpoint,
    rank_file: dict[str, Any], objects: dict[str, Any], strict: bool, trust: bool,
) -> dict[str, Any]:
    """Put the saved state of the step ``directory`` into ``objects``; models are filled straight from
    the file. Returns the step's ``extra`` values.

    Raises:
        CheckpointError: the step lacks one of ``objects``, or one cannot take its state.
        StateDictMismatchError: a model does not fit its saved state.
    """
    check_world_size(directory, saved_world, dist.world_size, rank_file["objects"], list(objects))
    shared = shared_file.tree["objects"]
    objects = restore_sharded(directory, objects, dist, shared, shared_file.materialize,
                              trust=trust, strict=strict)  # FSDP models/optimizers
    available = {**shared, **rank_file["objects"]}
    for name, obj in objects.items():
        if name not in available:
            raise CheckpointError(
                f"{directory} has no state for {name!r}; it holds: {', '.join(sorted(available)) or 'nothing'}."
            )
        if isinstance(obj, nn.Module):
            inner, remapped, own = match_state_dict(obj, available[name], strict=strict)  # checks first
            filled = OrderedDict(shared_file.fill_state_dict(remapped, own))
            if hasattr(remapped, "_metadata"):
                filled._metadata = remapped._metadata  # type: ignore[attr-defined]
            inner.load_state_dict(filled, strict=strict)
        else:
            try:
                obj.load_state_dict(shared_file.materialize(available[name]))
            except CheckpointError as exc:  # e.g. a mid-epoch data position, other world size
                raise CheckpointError(f"Cannot resume {name!r} from {directory}: {exc}") from exc
    meta = shared_file.tree["gpukit"]
    extra = dict(shared_file.materialize(meta.get("extra")) or {})
    replay_ddp_buckets(objects, meta.get("ddp_buckets"), str(directory))  # 3+ processes: exact
    return extra

def open_step(directory: Path, dist: DistContext, trust: bool) -> tuple[dict[str, Any], LazyCheckpoint, Any]:
    """``(marker, shared file, this rank's file)`` of a step, everything checked before use.

    Raises:
        CheckpointError: anything in the step is incomplete, special, damaged or unsafe.
    """
    marker, problem = read_marker(directory)
    if marker is None:
        raise CheckpointError(f"{directory} is not a complete gpukit checkpoint: {problem}.")
    rank = dist.rank if dist.rank < marker["world_size"] else 0  # another world size: checked later
    shared_file = load_lazy(directory / SHARED_FILE, trust=trust)  # tensors stay on disk until placed
    try:
        rank_file = load(directory / rank_file_name(rank), map_location="cpu", trust=trust)
        check_step_files(directory, shared_file.tree, rank_file)
        check_ddp_buckets(shared_file.tree["gpukit"].get("ddp_buckets"), str(directory / SHARED_FILE))
        if is_sharded_checkpoint(directory):
            read_metadata(directory, trust)  # the shard index, unpickled safely and checked
    except BaseException:
        shared_file.close()
        raise
    return marker, shared_file, rank_file
