"""Which objects a sharded (DCP) step directory holds, from its index: the tensors of each, which are
optimizers, the one to read. Shared by merging (``_merge.py``) and reading tensors by name
(``_tensor_files.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpukit.errors import ConfigurationError

__all__ = ["chosen_object", "is_optimizer", "tensor_entries"]


def tensor_entries(metadata: Any) -> dict[str, Any]:
    """The index's tensor entries (not the bytes ones), by key."""
    return {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}


def is_optimizer(keys: list[str], name: str) -> bool:
    """Whether the object ``name`` is an optimizer (its keys are ``state.`` / ``param_groups.``)."""
    return any(k.startswith((f"{name}.state.", f"{name}.param_groups.")) for k in keys)


def chosen_object(metadata: Any, select: str | None, source: Path) -> tuple[str, dict[str, Any]]:
    """``(name, {key without the name's prefix: entry})`` of the object ``select`` (default: the only model).

    Raises:
        ConfigurationError: ``select`` names nothing, or several models and none chosen.
    """
    tensors = tensor_entries(metadata)
    keys = list(metadata.state_dict_metadata)
    names = sorted({k.split(".", 1)[0] for k in keys})
    models = [n for n in names if not is_optimizer(keys, n)]
    if select is None:
        if len(models) != 1:
            raise ConfigurationError(
                f"{source} holds the sharded objects {', '.join(names)}; choose one to merge with "
                "--select NAME (e.g. --select model).")
        select = models[0]
    prefix = f"{select}."
    chosen = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not chosen:
        raise ConfigurationError(f"--select {select!r}: {source} has no sharded object or tensors under that "
                                 f"name; it holds: {', '.join(names)}.")
    return select, chosen
