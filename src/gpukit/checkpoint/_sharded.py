"""Sharded models (FSDP2) and their optimizers in a step directory, via torch.distributed.checkpoint.

Inside a :class:`~gpukit.checkpoint.CheckpointManager` step directory a sharded save adds::

    __0_0.distcp, __1_0.distcp, ...   each rank's shards of every sharded object (written in parallel)
    .metadata                         which shard holds which slice of which tensor (rank 0 writes it)

Keys are ``<object name>.<key in its state dict>``: ``model.layers.0.weight``,
``optimizer.state.layers.0.weight.exp_avg``. Model and optimizer state come from
``torch.distributed.checkpoint.state_dict`` (fully qualified parameter names, no wrapper
prefixes), so a checkpoint saved by N processes loads into M processes (DCP reshards), into
an unsharded model, and ``gpukit ckpt convert`` can merge it tensor by tensor.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.checkpoint._dist import DistContext
from gpukit.errors import CheckpointError, StateDictMismatchError, UnsafeCheckpointError

__all__ = ["METADATA_FILE", "check_models_fit", "is_sharded_checkpoint", "read_metadata", "restore_sharded",
           "sharded_names", "sharded_state", "split_sharded", "write_sharded"]

#: DCP's index file in a sharded step directory
METADATA_FILE = ".metadata"


def _is_sharded_module(obj: Any) -> bool:
    if not isinstance(obj, nn.Module):
        return False
    # A model with DTensor parameters cannot exist before torch.distributed.tensor was imported:
    # when it is not, nothing is sharded, and importing it (~0.3 s) only to find that out is waste.
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None:
        return False
    return any(isinstance(p, tensor_module.DTensor) for p in obj.parameters())


def _owner(optimizer: torch.optim.Optimizer, models: dict[str, nn.Module]) -> nn.Module | None:
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for model in models.values():
        if any(id(p) in params for p in model.parameters()):
            return model
    return None


def split_sharded(objects: dict[str, Any]) -> dict[str, Any]:
    """The objects a save must shard: FSDP-sharded models and the optimizers of their parameters."""
    models = {n: o for n, o in objects.items() if _is_sharded_module(o)}
    optimizers = {
        n: o for n, o in objects.items()
        if isinstance(o, torch.optim.Optimizer) and _owner(o, models) is not None
    }
    return {**models, **optimizers}


def _state_dicts(targets: dict[str, Any], objects: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    models = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    state: dict[str, Any] = {}
    for name, obj in targets.items():
        if isinstance(obj, nn.Module):
            state[name] = get_model_state_dict(obj)
            continue
        owner = _owner(obj, models)
        if owner is None:
            raise CheckpointError(
                f"The sharded checkpoint's optimizer {name!r} needs its model: pass the model "
                f"too, e.g. resume(model=model, {name}={name})."
            )
        state[name] = get_optimizer_state_dict(owner, obj)
    return state


def _failures(exc: Exception) -> str:
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    parts = []
    for rank, failure in sorted(failures.items()):
        inner = getattr(failure, "exception", failure)  # DCP wraps each rank's exception...
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]  # ... with its traceback
        parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
    return "; ".join(parts)


def sharded_state(sharded: dict[str, Any]) -> dict[str, Any]:
    """The state DCP writes for the objects of :func:`split_sharded` (DTensors: this rank's shards)."""
    return _state_dicts(sharded, sharded) if sharded else {}


def write_sharded(directory: Path, state: dict[str, Any], dist: DistContext) -> str | None:
    """Every rank writes its shards (``state``, from :func:`sharded_state` or a host snapshot of
    it) into ``directory`` (a collective; on the background channel in a background save).

    Returns:
        ``None``, or what failed, naming the rank(s) (the same text on every rank).

    Raises:
        CheckpointError: a rank never took part (killed): raised within the checkpoint timeout.
    """
    if not state:
        return None
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(directory, sync_files=True)
    try:
        if dist.world_size == 1:
            dcp.save(state, storage_writer=writer)
        else:
            dist.run_collective("sharded save", lambda group: dcp.save(state, storage_writer=writer, process_group=group))
    except dcp.CheckpointException as exc:  # DCP gathered each rank's failure onto every rank
        return f"writing the shards failed: {_failures(exc)}"
    return None


def is_sharded_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds DCP shards (an index of any kind: a special file is refused on reading)."""
    return os.path.lexists(Path(directory) / METADATA_FILE)


def read_metadata(directory: Path, trust: bool = False) -> Any:
    """DCP's metadata of a sharded step directory (tensor shapes, dtypes, shard locations).

    Read without running code and checked against the shard files (see ``_shard_index``);
    ``trust=True`` unpickles it freely, as DCP itself does.
    """
    from gpukit.checkpoint._shard_index import read_shard_index

    return read_shard_index(directory, trust)


def sharded_names(directory: Path, trust: bool = False) -> set[str]:
    """Names of the objects stored as shards in ``directory`` (empty for an unsharded checkpoint)."""
    if not is_sharded_checkpoint(directory):
        return set()
    return {key.split(".", 1)[0] for key in read_metadata(directory, trust).state_dict_metadata}


def check_models_fit(directory: Path, metadata: Any, targets: dict[str, Any], state: dict[str, Any],
                     strict: bool = True, rank: int = 0) -> None:
    """Refuse, before DCP loads anything, models whose keys or shapes differ from the shards.

    The same grouped message (missing / unexpected / shape) as an unsharded resume, instead
    of DCP's per-rank tracebacks naming only the first difference; every rank finds the same
    differences, and only rank 0's error lists them (the others point to it). Without ``strict`` the keys
    the shards lack are left out of ``state`` (their values stay as they are).

    Raises:
        StateDictMismatchError: a shape differs, or (with ``strict``) keys are missing or unexpected.
    """
    from gpukit.checkpoint._prefixes import _mismatch_message

    saved = metadata.state_dict_metadata
    for name, model in targets.items():
        if not isinstance(model, nn.Module):
            continue
        prefix = f"{name}."
        ours = state[name]
        theirs = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}
        missing = [k for k in ours if k not in theirs]
        unexpected = [k for k in theirs if k not in ours]
        shapes = [(k, tuple(theirs[k].size), tuple(v.shape)) for k, v in ours.items()
                  if k in theirs and hasattr(theirs[k], "size") and isinstance(v, torch.Tensor)
                  and tuple(theirs[k].size) != tuple(v.shape)]
        if shapes or (strict and (missing or unexpected)):
            message = (_mismatch_message(model, list(theirs), missing, unexpected, shapes) if rank == 0 else
                       "the model does not fit its saved state (rank 0's error lists the differences).")
            raise StateDictMismatchError(f"Cannot resume {name!r} from the shards in {directory}: {message}")
        for key in missing:
            del ours[key]


def _raise_refusal(exc: Exception) -> None:
    """Re-raise a rank's UnsafeCheckpointError that DCP wrapped into its CheckpointException."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = getattr(failure, "exception", failure)
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, UnsafeCheckpointError):
            raise UnsafeCheckpointError(str(inner)) from None


def _by_name(optimizer: torch.optim.Optimizer, owner: nn.Module, saved: dict[str, Any]) -> dict[str, Any]:
    """A plain ``optimizer.state_dict()`` (parameters numbered) keyed by parameter names instead."""
    names = {id(p): n for n, p in owner.named_parameters()}
    index_to_name = {
        index: names[id(p)]
        for saved_group, group in zip(saved["param_groups"], optimizer.param_groups)
        for index, p in zip(saved_group["params"], group["params"])
    }
    return {
        "state": {index_to_name[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [index_to_name[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def _unsharded_into_sharded(
    objects: dict[str, Any], saved: dict[str, Any], materialize: Callable[[Any], Any]
) -> dict[str, Any]:
    """Full state saved without sharding (DDP, one process) put into FSDP-sharded objects."""
    targets = {n: o for n, o in split_sharded(objects).items() if n in saved}
    if not targets:  # the common case (nothing sharded here): DCP is never imported
        return objects
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from gpukit.checkpoint._prefixes import strip_wrapper_prefixes

    full = StateDictOptions(full_state_dict=True)
    models = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    for name, obj in targets.items():
        try:
            if isinstance(obj, nn.Module):
                set_model_state_dict(obj, strip_wrapper_prefixes(materialize(saved[name])), options=full)
            else:
                owner = _owner(obj, models)
                set_optimizer_state_dict(owner, obj, _by_name(obj, owner, materialize(saved[name])), options=full)  # type: ignore[arg-type]
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"Cannot load the unsharded state of {name!r} into its FSDP-sharded "
                                  f"counterpart: {type(exc).__name__}: {exc}") from exc
    return {n: o for n, o in objects.items() if n not in targets}


def restore_sharded(
    directory: Path, objects: dict[str, Any], dist: DistContext, saved: dict[str, Any] | None = None,
    materialize: Callable[[Any], Any] = lambda tree: tree, *, trust: bool = False, strict: bool = True,
) -> dict[str, Any]:
    """Load the sharded objects of ``directory`` into ``objects`` (sharded or not, any world size).

    Also loads an unsharded checkpoint's models and optimizers (``saved``: its shared objects,
    whose tensors ``materialize`` reads in when still on disk) into FSDP-sharded ones, so a DDP
    or one-process run can continue under FSDP.

    The shard index is read without running code, and non-tensor entries with
    ``weights_only=True``, unless ``trust``. Models are checked against the index first
    (``strict`` as in ``load_state_dict``).

    Returns:
        The objects left for the unsharded files.

    Raises:
        CheckpointError: a shard is missing or unreadable.
        StateDictMismatchError: a model does not fit its saved state (before anything is loaded).
        UnsafeCheckpointError: the index or a shard entry would need full unpickling.
    """
    metadata = read_metadata(directory, trust) if is_sharded_checkpoint(directory) else None
    names = {key.split(".", 1)[0] for key in metadata.state_dict_metadata} & set(objects) if metadata else set()
    if not names:
        return _unsharded_into_sharded(objects, saved, materialize) if saved else objects
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from gpukit.checkpoint._shard_index import SafeLoadPlanner, SafeReader

    targets = {n: objects[n] for n in sorted(names)}
    state = _state_dicts(targets, objects)
    check_models_fit(directory, metadata, targets, state, strict, dist.rank)
    reader = SafeReader(directory, metadata, trust)
    planner = SafeLoadPlanner(directory, trust)
    try:
        if dist.world_size == 1:
            with warnings.catch_warnings():  # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, storage_reader=reader, planner=planner)
        else:
            dist.run_collective("sharded load", lambda group: dcp.load(
                state, storage_reader=reader, planner=planner, process_group=group))
    except (dcp.CheckpointException, RuntimeError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        _raise_refusal(exc)
        raise CheckpointError(f"Cannot restore {', '.join(sorted(names))} from the shards in {directory}: "
                              f"{_failures(exc)}") from exc
    models = {n: o for n, o in objects.items() if isinstance(o, nn.Module)}
    for name, obj in targets.items():
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, state[name], options=StateDictOptions(strict=strict))
        else:
            set_optimizer_state_dict(_owner(obj, models), obj, state[name])  # type: ignore[arg-type]
    return {n: o for n, o in objects.items() if n not in names}
