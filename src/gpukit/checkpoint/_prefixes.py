"""Wrapper prefixes in state-dict keys, and loading state dicts whatever their prefixes.

DataParallel and DistributedDataParallel put ``module.`` in front of every key; torch.compile
puts ``_orig_mod.`` in front (or, for compiled submodules, in the middle). gpukit saves keys
without them and loads keys with or without them into models wrapped or not.
"""

from __future__ import annotations


from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gpukit.checkpoint._keys import group_keys
from gpukit.errors import ConfigurationError, StateDictMismatchError

__all__ = [
    "WRAPPER_PREFIXES",
    "canonical_key",
    "strip_wrapper_prefixes",
    "detect_prefixes",
    "describe_wrappers",
    "match_state_dict",
]

#: prefix -> the wrapper that adds it
WRAPPER_PREFIXES: dict[str, str] = {
    "module.": "DataParallel/DistributedDataParallel",
    "_orig_mod.": "torch.compile",
}
_COMPILE_SEGMENT = "_orig_mod."


def canonical_key(key: str) -> str:
    """``key`` without torch.compile segments and without leading ``module.``."""
    key = key.replace("." + _COMPILE_SEGMENT, ".")
    while key.startswith(tuple(WRAPPER_PREFIXES)):
        key = key.split(".", 1)[1]
    return key


def _without_compile_segments(key: str) -> str:
    key = key.replace("." + _COMPILE_SEGMENT, ".")
    while key.startswith(_COMPILE_SEGMENT):
        key = key[len(_COMPILE_SEGMENT) :]
    return key


def strip_wrapper_prefixes(state_dict: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    """A copy of ``state_dict`` without wrapper prefixes.

    ``_orig_mod.`` segments are removed wherever they are; a leading ``module.`` only when
    every key has it (a model may own a submodule that is really called ``module``).
    """
    keys = [_without_compile_segments(k) for k in state_dict]
    while keys and all(k.startswith("module.") for k in keys):
        keys = [_without_compile_segments(k[len("module.") :]) for k in keys]
    out: OrderedDict[str, Any] = OrderedDict(zip(keys, state_dict.values()))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (canonical_key(name + ".")[:-1] if name else name, value) for name, value in metadata.items()
        )
    return out


def detect_prefixes(keys: Iterable[str]) -> list[str]:
    """Human-readable notes on the wrapper prefixes found in ``keys`` (empty if none)."""
    key_list = list(keys)
    notes: list[str] = []
    for prefix, wrapper in WRAPPER_PREFIXES.items():
        leading = sum(1 for k in key_list if k.startswith(prefix))
        inner = sum(1 for k in key_list if not k.startswith(prefix) and f".{prefix}" in k)
        if leading:
            notes.append(f"'{prefix}' ({wrapper}) on {leading} of {len(key_list)} keys")
        if inner and prefix == _COMPILE_SEGMENT:
            notes.append(f"'{prefix}' inside {inner} keys (compiled submodules)")
    return notes


def describe_wrappers(model: nn.Module) -> str:
    """``"Net"`` or ``"Net (wrapped: DistributedDataParallel > OptimizedModule)"``."""
    from gpukit.placement import unwrap_model

    inner = unwrap_model(model)
    if inner is model:
        return type(model).__name__
    chain: list[str] = []
    current: Any = model
    while isinstance(current, nn.Module) and current is not inner:
        chain.append(type(current).__name__)
        # _modules, not attributes: OptimizedModule forwards unknown attributes to the model
        children = current._modules
        current = children.get("_orig_mod") if "_orig_mod" in children else children.get("module")
    return f"{type(inner).__name__} (wrapped: {' > '.join(chain)})"


def _match(key: str, targets: Mapping[str, str]) -> str | None:
    """The canonical model key that ``key`` names, trying ever shorter wrapper prefixes."""
    candidate = _without_compile_segments(key)
    while True:
        if candidate in targets:
            return candidate
        if not candidate.startswith("module."):
            return None
        candidate = _without_compile_segments(candidate[len("module.") :])


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, nn.parameter.UninitializedParameter):
        return None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _mismatch_message(
    model: nn.Module,
    incoming_keys: list[str],
    missing: list[str],
    unexpected: list[str],
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
) -> str:
    counts = ", ".join(
        f"{n} {what}" for n, what in ((len(missing), "missing"), (len(unexpected), "unexpected"),
                                      (len(shapes), "shape-mismatched")) if n
    )
    lines = [f"State dict does not fit the model {describe_wrappers(model)}: {counts} key(s)."]
    prefixes = detect_prefixes(incoming_keys)
    lines.append(
        "Wrapper prefixes in the state dict (handled automatically): " + "; ".join(prefixes)
        if prefixes else "No wrapper prefixes (module., _orig_mod.) in the state dict."
    )
    if missing:
        lines.append("Missing from the state dict (the model has them):")
        lines += [f"  {line}" for line in group_keys(missing)]
    if unexpected:
        lines.append("Unexpected in the state dict (the model does not have them):")
        lines += [f"  {line}" for line in group_keys(unexpected)]
    if shapes:
        lines.append("Shape mismatch (state dict vs model):")
        by_shapes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = {}
        for key, got, want in shapes:
            by_shapes.setdefault((got, want), []).append(key)
        shape_lines = [
            f"  {line.split('  (')[0]}: {list(got)} vs {list(want)}" + (f"  ({len(keys)} keys)" if len(keys) > 1 else "")
            for (got, want), keys in by_shapes.items() for line in group_keys(keys, max_lines=1)[:1]
        ]
        lines += shape_lines[:8]
        if len(shape_lines) > 8:
            lines.append(f"  ... and {len(shape_lines) - 8} more shape(s)")
    hint = _extra_prefix_hint(missing, unexpected)
    lines.append(hint or (
        "Fix: load a checkpoint of the same architecture, or pass strict=False to load only the "
        "keys that match (shape-mismatched keys are never loaded)."
    ))
    return "\n".join(lines)


def _extra_prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """Spot a foreign prefix such as Lightning's ``model.`` that explains the mismatch."""
    if not missing or not unexpected:
        return None
    first = {k.split(".", 1)[0] for k in unexpected}
    if len(first) == 1 and all("." in k for k in unexpected):
        prefix = first.pop() + "."
        if {k[len(prefix):] for k in unexpected} & set(missing):
            return (f"Hint: every unexpected key starts with '{prefix}'; strip it first: "
                    f"{{k.removeprefix('{prefix}'): v for k, v in state_dict.items()}}.")
    return None


def match_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> tuple[nn.Module, "OrderedDict[str, Any]", dict[str, Any]]:
    """The checks and key matching of :func:`load_state_dict`, without loading anything.

    Only shapes are compared, so ``state_dict`` may hold meta tensors (a checkpoint not read yet).

    Returns:
        ``(inner, remapped, own)``: the unwrapped model, ``state_dict`` keyed by the model's
        real names (``_metadata`` kept), and the model's own state dict by the same names.

    Raises:
        The errors of :func:`load_state_dict`.
    """
    from gpukit.placement import unwrap_model

    _check_is_state_dict(state_dict)
    inner = unwrap_model(model)
    own = inner.state_dict()
    targets: dict[str, str] = {_without_compile_segments(k): k for k in own}  # canonical -> real
    _check_not_training_state(state_dict, targets)
    incoming_keys = list(state_dict)
    remapped: OrderedDict[str, Any] = OrderedDict()
    unexpected: list[str] = []
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for key, value in state_dict.items():
        canonical = _match(key, targets)
        if canonical is None:
            stripped = canonical_key(key)
            unexpected.append(stripped)
            remapped[stripped] = value
            continue
        real = targets[canonical]
        got, want = _shape(value), _shape(own[real])
        if got is not None and want is not None and got != want:
            shapes.append((canonical, got, want))
        remapped[real] = value
    matched = {k for k in remapped if k in own}
    missing = [canonical for canonical, real in targets.items() if real not in matched]
    if shapes or (strict and (missing or unexpected)):
        raise StateDictMismatchError(_mismatch_message(model, incoming_keys, missing, unexpected, shapes))
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        modules = {_without_compile_segments(n + "."): n for n, _ in inner.named_modules()}
        remapped._metadata = OrderedDict()  # type: ignore[attr-defined]
        for name, value in metadata.items():
            target = _match(name + ".", modules)
            remapped._metadata[(modules[target] if target is not None else name)] = value  # type: ignore[attr-defined]
    return inner, remapped, own


_MODEL_ENTRIES = ("model", "state_dict", "model_state_dict", "module", "net", "network", "ema")


def _check_is_state_dict(state_dict: Any) -> None:
    if isinstance(state_dict, Mapping):
        return
    if isinstance(state_dict, bytes):
        raise ConfigurationError(
            f"load_state_dict(model, state_dict) got bytes ({state_dict[:40]!r}...); give a state dict or the "
            "path of a checkpoint file as a str or pathlib.Path."
        )
    raise ConfigurationError(
        f"load_state_dict(model, state_dict) got a {type(state_dict).__name__}; it needs a "
        "mapping of parameter names to tensors, such as model.state_dict() or what "
        "gpukit.load(path) returns."
    )


def _check_not_training_state(state_dict: Mapping[str, Any], targets: Mapping[str, str]) -> None:
    """Refuse ``{"model": {...}, "optimizer": {...}, "epoch": 3}``: nothing in it would load."""
    nested = [str(k) for k, v in state_dict.items() if isinstance(v, Mapping)]
    if not nested or any(_match(str(k), targets) is not None for k in state_dict):
        return
    shown = ", ".join(repr(str(k)) for k in list(state_dict)[:8])
    more = f", ... ({len(state_dict)} in all)" if len(state_dict) > 8 else ""
    model_keys = [k for k in nested if k.lower() in _MODEL_ENTRIES] or nested
    fix = " or ".join(f"state[{k!r}]" for k in model_keys[:3])
    raise ConfigurationError(
        f"load_state_dict(model, state) got a training state with entries {shown}{more}, not "
        "a model state dict: none of its keys is a parameter or buffer of the model, and "
        f"{len(nested)} of its values are dicts themselves. Pass the model's part: "
        f"load_state_dict(model, {fix})."
    )
