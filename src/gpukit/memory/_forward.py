"""The planner's forward-only (inference) mode: per unit of a model, its weights and the peak of
the activations one forward makes, on fake tensors (no memory, no GPU).

A model is cut into *units*, the pieces an inference placement moves as one: each block (found
by structure, :func:`~gpukit.memory.find_blocks`) and, around the blocks, every largest module
that holds no block (an embedding, the final norm, the output head, a rotary table). One forward
of the stated workload runs under ``no_grad`` on fake tensors (``_simulate.py``'s counting mode,
weights not counted), with a mark at each unit's entry and exit, so each unit reports what was
live when it started (the hidden state and anything else carried along) and the highest point
it reached above that. The KV cache is not in the forward (it runs without a cache) but added
by formula where a model says its shape (Hugging Face configs): 2 x kv_heads x head_dim x tokens
x batch x dtype bytes per layer.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory._blocks import find_blocks, inside
from gpukit.memory._simulate import LiveBytes, _CountingFakeMode, _quiet_fake_tensor_log, call_model

__all__ = ["ForwardUnit", "KvShape", "check_workload", "forward_units", "kv_shape", "model_units", "planned_dtype",
           "unit_tensor_names"]


@dataclass(frozen=True)
class KvShape:
    """What one layer's KV cache holds per token and sequence: ``2 x kv_heads x head_dim`` values."""

    layers: int
    kv_heads: int
    head_dim: int

    def layer_bytes(self, batch: int, tokens: int, dtype: torch.dtype) -> int:
        """One layer's keys and values for ``batch`` sequences of ``tokens`` tokens."""
        return 2 * self.kv_heads * self.head_dim * tokens * batch * dtype.itemsize


@dataclass(frozen=True)
class ForwardUnit:
    """One unit of a model as a forward-only plan sees it, in the order the forward runs them.

    Attributes:
        name: qualified module name ("model.layers.3"; "" for the root's own tensors).
        weights_bytes: its parameters and buffers in the planned dtype; a tied tensor is counted in
            the first unit that holds it only (``tied_to`` names that unit in the others).
        live_in_bytes: activations (and inputs) live when it starts.
        peak_above_bytes: the highest point its forward reached above ``live_in_bytes``.
        layer: which layer of the KV cache it holds (``None``: none).
        tied_to: the earlier unit whose tensor it shares (it must sit where that one does).
    """

    name: str
    weights_bytes: int
    live_in_bytes: int
    peak_above_bytes: int
    layer: int | None = None
    tied_to: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of ``model`` in definition order (see the module docstring)."""
    blocks = find_blocks(model)
    block_names = {name for name, _ in blocks}
    units: list[tuple[str, nn.Module]] = []
    chosen: set[str] = set()
    for name, module in model.named_modules():
        if module is model or inside(name, chosen):
            continue
        if name in block_names:
            units.append((name, module))
            chosen.add(name)
            continue
        holds_block = any(b.startswith(f"{name}.") for b in block_names)
        has_tensors = any(True for _ in module.parameters()) or any(True for _ in module.buffers())
        if not holds_block and has_tensors:
            units.append((name, module))
            chosen.add(name)
    own = [*model.parameters(recurse=False), *model.buffers(recurse=False)]
    parents_with_own = [n for n, m in model.named_modules() if m is not model and n not in chosen
                        and not inside(n, chosen)
                        and any(True for _ in [*m.parameters(recurse=False), *m.buffers(recurse=False)])]
    if own or parents_with_own:  # tensors held outside every unit: the root runs them
        units.append(("", model))
    return units


def kv_shape(model: nn.Module) -> KvShape | None:
    """The KV cache's shape per layer from a Hugging Face-style config; ``None`` when it has none."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head")
    kv_heads = _first(text, "num_key_value_heads", "n_kv_heads") or heads
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    head_dim = _first(text, "head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return KvShape(int(layers), int(kv_heads), int(head_dim))


def _first(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def planned_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``tensor`` has when the model runs in ``dtype``: floating tensors are cast to it,
    except one-byte floats (float8: quantised weights, kept as stored), and the rest keep theirs."""
    return dtype if tensor.is_floating_point() and tensor.element_size() > 1 else tensor.dtype


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * planned_dtype(tensor, dtype).itemsize


def forward_units(model: nn.Module, example_batch: Any, dtype: torch.dtype,
                  units: list[tuple[str, nn.Module]] | None = None) -> list[ForwardUnit]:
    """Run one forward of ``model`` on fake tensors and size every unit.

    Args:
        model: the model (meta, CPU or anywhere: nothing is read or changed).
        example_batch: its input (a tensor, a tuple for ``model(*batch)``, a dict for
            ``model(**batch)``); only shapes and dtypes are used. Floating inputs take ``dtype``.
        dtype: the dtype the floating-point weights will have.
        units: the units (default :func:`model_units`).

    Returns:
        The units in the order the forward ran them (units it never ran come last).

    Raises:
        MemoryPlanError: the model cannot run on fake tensors.
    """
    units = model_units(model) if units is None else units
    blocks = {name: i for i, (name, _) in enumerate(find_blocks(model))}
    kv = kv_shape(model)
    tensors = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    names = unit_tensor_names(model, [n for n, _ in units if n])
    owner: dict[int, str] = {}  # tensor -> the first unit holding it (a tied tensor counts there only)
    weights: dict[str, int] = {}
    tied: dict[str, str | None] = {}
    for name in [n for n, _ in units if n] + [""]:
        total, tied_to = 0, None
        for qualified in names.get(name, []):
            t = tensors[qualified]
            if id(t) not in owner:
                owner[id(t)] = name
                total += _tensor_bytes(t, dtype)
            elif owner[id(t)] != name:
                tied_to = owner[id(t)]
        weights[name], tied[name] = total, tied_to
    if not names[""]:
        units = [(n, m) for n, m in units if n]
    seen = _simulate_forward(model, example_batch, dtype, [(n, m) for n, m in units if n])
    order = list(seen) + [n for n, _ in units if n not in seen]
    out = []
    for name in order:
        live_in, above = seen.get(name, (0, 0))
        layer = blocks.get(name) if kv is not None and blocks.get(name, kv.layers) < kv.layers else None
        out.append(ForwardUnit(name, weights[name], live_in, above, layer, tied[name]))
    return out


def _simulate_forward(model: nn.Module, batch: Any, dtype: torch.dtype,
                      units: list[tuple[str, nn.Module]]) -> dict[str, tuple[int, int]]:
    """``{unit: (live at entry, peak above it)}`` in the order the units first ran."""
    tracker = LiveBytes(1)
    seen: dict[str, tuple[int, int]] = {}
    stack: list[tuple[str, int, int]] = []
    handles = []

    def enter(name: str) -> Any:
        def hook(*_: Any) -> None:
            stack.append((name, tracker.live, tracker.peak))
            tracker.peak = tracker.live
        return hook

    def leave(name: str) -> Any:
        def hook(*_: Any) -> None:
            _, live_in, outer_peak = stack.pop()
            above = tracker.peak - live_in
            old = seen.get(name, (0, 0))
            seen[name] = (max(old[0], live_in), max(old[1], above))
            tracker.peak = max(outer_peak, tracker.peak)
        return hook

    for name, module in units:
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name)))
    try:
        with _quiet_fake_tensor_log(), _CountingFakeMode(tracker), torch.no_grad():
            fakes: dict[int, torch.Tensor] = {}  # one fake per tensor: tied names share it
            state = {n: fakes.setdefault(id(t), torch.empty(t.shape, dtype=planned_dtype(t, dtype)))
                     for n, t in [*model.named_parameters(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False)]}
            for fake in fakes.values():  # known, not counted: views of weights (a transpose) are no new memory
                tracker.track(fake)
            tracker.live = tracker.peak = 0
            inputs = tree_map(lambda t: _fake_input(t, dtype, tracker), batch)
            from torch.nn.utils.stateless import _reparametrize_module

            with tracker, _reparametrize_module(model, state):
                call_model(model, _without_cache(model, inputs))
    except (RuntimeError, TypeError, NotImplementedError, ValueError, IndexError, KeyError) as exc:
        raise MemoryPlanError(
            f"The inference plan could not run {type(model).__name__} on fake tensors ({type(exc).__name__}: "
            f"{str(exc)[:300]}). Check the example input's shapes and dtypes (token ids are int64); operations "
            "that read tensor values cannot run without data.") from None
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _fake_input(value: Any, dtype: torch.dtype, tracker: LiveBytes) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    fake = torch.empty(value.shape, dtype=dtype if value.is_floating_point() else value.dtype)
    tracker.track(fake)
    return fake


def _without_cache(model: nn.Module, inputs: Any) -> Any:
    """A Hugging Face model's keyword inputs with no cache (the plan adds it by formula) and, where
    the model takes it, only the last position's logits (as ``generate`` asks for)."""
    if not isinstance(inputs, dict) or kv_shape(model) is None:
        return inputs
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return inputs
    extra: dict[str, Any] = {}
    if "use_cache" in parameters and "use_cache" not in inputs:
        extra["use_cache"] = False
    if "logits_to_keep" in parameters and "logits_to_keep" not in inputs:
        extra["logits_to_keep"] = 1
    return {**inputs, **extra}


def unit_tensor_names(model: nn.Module, unit_names: list[str]) -> dict[str, list[str]]:
    """Every parameter and buffer name of ``model`` (tied aliases included) under the innermost unit
    holding it; ``""`` gathers those of no unit (the root's own, a container's)."""
    chosen = set(unit_names)
    out: dict[str, list[str]] = {name: [] for name in unit_names}
    out.setdefault("", [])
    for qualified, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        parts = qualified.split(".")
        holder = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in chosen), "")
        out[holder].append(qualified)
    return out


def check_workload(batch_size: int, prompt_len: int, new_tokens: int) -> None:
    """Refuse a workload no model runs (the numbers come from users and CLIs)."""
    for label, value, least in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1), ("new_tokens", new_tokens, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigurationError(f"{label}={value!r}: expected a whole number of at least {least}.")
