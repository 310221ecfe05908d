"""Which layers a model is split into: the children of an ``nn.Sequential``, or the
sub-modules a user names for any other model (applied one after the other)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["resolve_layers"]

_LAYERS_HELP = (
    'layers=["embed", "blocks", "head"] (attribute names, dotted paths such as "encoder.0", or '
    "the sub-modules themselves; a ModuleList/Sequential named there counts as its children)"
)


def resolve_layers(
    model: nn.Module, layers: Sequence[str | nn.Module] | None
) -> tuple[list[str], list[nn.Module]]:
    """``(names, modules)`` of the layers that run one after the other, in order.

    Raises:
        ConfigurationError: ``model`` is not an ``nn.Sequential`` and no ``layers`` were named;
            a name that is not a sub-module; a layer named twice or inside another; parameters
            or buffers of ``model`` outside every layer (the chained forward would not use them).
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"split(model=...) needs an nn.Module, got {type(model).__name__}.")
    if layers is None:
        if not isinstance(model, nn.Sequential):
            raise ConfigurationError(
                f"split() runs layers one after the other; {type(model).__name__} is not an "
                f"nn.Sequential, so name its layers in the order its forward runs them: {_LAYERS_HELP}. "
                "The split model then computes layers[-1](...layers[1](layers[0](x)))."
            )
        named = list(model.named_children())
    else:
        if isinstance(layers, (str, nn.Module)) or not isinstance(layers, Sequence) or not layers:
            raise ConfigurationError(f"split(layers={layers!r}) needs a non-empty list: {_LAYERS_HELP}.")
        named = []
        for item in layers:
            name = _name_of(model, item)
            module = model.get_submodule(name) if name else model
            if name and isinstance(module, (nn.ModuleList, nn.Sequential)):
                named += [(f"{name}.{child}", sub) for child, sub in module.named_children()]
            else:
                named.append((name, module))
    if not named:
        raise ConfigurationError(f"split(): {type(model).__name__} has no layers to split.")
    _check_disjoint([n for n, _ in named])
    _check_covered(model, [n for n, _ in named])
    return [n for n, _ in named], [m for _, m in named]


def _name_of(model: nn.Module, item: str | nn.Module) -> str:
    if isinstance(item, nn.Module):
        for name, module in model.named_modules():
            if module is item and name:
                return name
        raise ConfigurationError(
            f"split(layers=[...]) got a {type(item).__name__} that is not a sub-module of "
            f"{type(model).__name__}; name sub-modules of the model being split."
        )
    if not isinstance(item, str) or not item:
        raise ConfigurationError(f"split(layers=[...]) got {item!r}; use {_LAYERS_HELP}.")
    try:
        model.get_submodule(item)
    except AttributeError:
        children = ", ".join(repr(n) for n, _ in model.named_children()) or "none"
        raise ConfigurationError(
            f"split(layers=[..., {item!r}, ...]): {type(model).__name__} has no sub-module "
            f"{item!r} (its children: {children})."
        ) from None
    return item


def _check_disjoint(names: list[str]) -> None:
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if a == b or a.startswith(b + ".") or b.startswith(a + "."):
                raise ConfigurationError(
                    f"split(layers=[...]) names {a!r} and {b!r}, which overlap; each sub-module "
                    "may belong to one layer only."
                )


def _check_covered(model: nn.Module, names: list[str]) -> None:
    prefixes = tuple(n + "." for n in names)
    outside = [
        key for key, _ in [*model.named_parameters(), *model.named_buffers()]
        if not key.startswith(prefixes)
    ]
    if outside:
        shown = ", ".join(repr(k) for k in outside[:5]) + (", ..." if len(outside) > 5 else "")
        raise ConfigurationError(
            f"split(): {len(outside)} parameter(s)/buffer(s) of {type(model).__name__} lie "
            f"outside the named layers ({shown}); the split model chains the layers only, so "
            "they would never be used or trained. Name the sub-modules that hold them, or move "
            "them into one (e.g. wrap a free parameter in a small module)."
        )
