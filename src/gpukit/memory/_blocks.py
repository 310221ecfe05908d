"""A model's blocks, and which sub-modules FSDP shards as units of their own (the wrapping policy).

It lives in ``gpukit.memory`` because the planner needs it as much as the FSDP strategy does
(both import it from ``gpukit.memory``).

Each unit's parameters are gathered just before it runs and freed right after, so the peak
holds one unit's full parameters, not the model's. The default policy, in this order:

1. every module whose class is a known transformer block (``nn.TransformerEncoderLayer``,
   ``nn.TransformerDecoderLayer``);
2. every element of a stack of blocks: an ``nn.ModuleList`` or ``nn.Sequential`` of two or
   more modules of one class that hold parameters (``model.layers``, ``model.h``,
   ``model.blocks`` in GPT-style models, the residual stages of a ResNet);
3. every other module whose own parameters (not its children's) number at least
   ``min_unit_params`` and that is not inside a unit chosen above (a large embedding or
   output layer);
4. the root, last (it holds whatever is left).

Override it with a set of module classes (only those become units) or a callable
``(module, qualified_name) -> bool``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Union

from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["AutoWrap", "BLOCK_TYPES", "DEFAULT_MIN_UNIT_PARAMS", "find_blocks", "inside", "unit_param_counts",
           "units_to_shard"]

#: module classes that are a unit of their own under the default policy
BLOCK_TYPES: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
#: own-parameter count from which any other module becomes a unit under the default policy
DEFAULT_MIN_UNIT_PARAMS = 1_000_000

AutoWrap = Union[None, Collection[type], Callable[[nn.Module, str], bool]]


def _stack_elements(root: nn.Module) -> set[int]:
    found: set[int] = set()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            kinds = {_plain_class(m) for m in module}
            if len(kinds) == 1 and any(True for _ in module[0].parameters()):
                found.update(id(m) for m in module)
    return found


def _plain_class(module: nn.Module) -> type:
    """The user's class of ``module`` (activation checkpointing swaps in a subclass of it)."""
    cls = type(module)
    return cls.__bases__[0] if getattr(cls, "_gpukit_checkpointed", False) else cls


def find_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks (rules 1 and 2 above), outermost only, in the order they are defined.

    FSDP makes each a unit; activation checkpointing recomputes each in backward.
    """
    stacked = _stack_elements(root)
    found: list[tuple[str, nn.Module]] = []
    names: set[str] = set()
    for name, module in root.named_modules():
        if module is root or inside(name, names):
            continue
        if isinstance(module, BLOCK_TYPES) or id(module) in stacked:
            found.append((name, module))
            names.add(name)
    return found


def inside(name: str, outer: set[str]) -> bool:
    """Whether ``name`` lies inside a module named in ``outer`` (one lookup per ancestor)."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in outer for i in range(1, len(parts)))


def units_to_shard(
    root: nn.Module,
    auto_wrap: AutoWrap = None,
    min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
    always: tuple[type[nn.Module], ...] = (),
) -> list[tuple[str, nn.Module]]:
    """The sub-modules to shard as units, innermost first; the root is not included.

    Args:
        root: the whole model.
        auto_wrap: ``None`` (the default policy above), a collection of module classes, or a
            callable ``(module, qualified_name) -> bool``.
        min_unit_params: rule 3's threshold (default policy only).
        always: classes that are units whatever the policy, when they hold parameters (the
            fp32 norm layers of a "-true" precision: one unit's parameters share one dtype).

    Returns:
        ``(qualified name, module)`` pairs in the order ``fully_shard`` must see them
        (children before their parents).

    Raises:
        ConfigurationError: ``auto_wrap`` is none of the allowed kinds.
    """
    named = [(n, m) for n, m in root.named_modules() if m is not root]
    if auto_wrap is None:
        stacked = _stack_elements(root)
        chosen = [(n, m) for n, m in named if isinstance(m, BLOCK_TYPES) or id(m) in stacked]
        inside = tuple(f"{n}." for n, _ in chosen)
        chosen_names = {n for n, _ in chosen}
        for name, module in named:
            if name in chosen_names or name.startswith(inside):
                continue
            if any(n.startswith(f"{name}.") for n in chosen_names):
                continue  # it contains units: it stays in its parent's (or the root's) unit
            own = sum(p.numel() for p in module.parameters(recurse=False))
            if own >= min_unit_params:
                chosen.append((name, module))
                chosen_names.add(name)
    elif callable(auto_wrap) and not isinstance(auto_wrap, type):
        chosen = [(n, m) for n, m in named if auto_wrap(m, n)]
    elif isinstance(auto_wrap, Collection) and all(isinstance(c, type) for c in auto_wrap):
        classes = tuple(auto_wrap)
        chosen = [(n, m) for n, m in named if isinstance(m, classes)]
    else:
        raise ConfigurationError(
            f"auto_wrap={auto_wrap!r} is not understood; give None (the default policy: "
            "transformer blocks, stacks of blocks, large layers), a set of module classes such "
            "as {nn.TransformerEncoderLayer}, or a callable (module, name) -> bool."
        )
    if always:
        have = {n for n, _ in chosen}
        chosen += [
            (n, m) for n, m in named
            if n not in have and isinstance(m, always) and any(True for _ in m.parameters())
        ]
    order = {name: i for i, (name, _) in enumerate(named)}
    # named_modules is pre-order (parents first); fully_shard needs children first
    return sorted(chosen, key=lambda item: -order[item[0]])


def unit_param_counts(root: nn.Module, units: list[tuple[str, nn.Module]]) -> list[int]:
    """Parameters each unit shards (nested units' excluded), the root's remainder last."""
    owner: dict[int, int] = {}
    for index, (_name, unit) in enumerate(units):  # innermost first: the first owner wins
        for p in unit.parameters():
            owner.setdefault(id(p), index)
    counts = [0] * (len(units) + 1)
    for p in root.parameters():
        counts[owner.get(id(p), len(units))] += p.numel()
    return counts
