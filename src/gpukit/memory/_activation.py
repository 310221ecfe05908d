"""Activation checkpointing: keep only each block's input in forward, recompute the block in backward.

A checkpointed block saves its input instead of every intermediate activation; during backward
it runs its forward again (``torch.utils.checkpoint`` with ``use_reentrant=False``) to rebuild
what its gradients need, one block at a time. Memory of activations drops from "every block's
intermediates" to "every block's input plus one block's intermediates", for about one extra
forward of compute (~+33% of a step whose backward costs twice the forward).

How it is applied: the block's class is swapped for a subclass (named like it) whose
``forward`` runs the original ``forward`` under ``checkpoint``. No wrapper module is inserted,
so no key ever gains a ``_checkpoint_wrapped_module.`` prefix: ``state_dict()`` and gpukit's
checkpoints are the plain model's and load with or without the option. ``fully_shard``,
DistributedDataParallel, DataParallel's replicas, ``copy.deepcopy`` and ``torch.compile``
all see an ordinary module whose forward happens to checkpoint.

The mechanism lives here, below the strategies, so that the planner can simulate it; the
strategies apply it in ``setup_module`` (``gpukit.strategies._checkpointing``).

Policies (``Session(activation_checkpointing=...)``, or on a strategy object):

- ``True`` / ``"full"``: every block, found as FSDP finds its units
  (:func:`gpukit.memory._blocks.find_blocks`: transformer layers, and the elements of a
  ``ModuleList``/``Sequential`` stack of same-class modules);
- ``"selective"``: every other block (blocks 0, 2, 4...): about half the saving for half
  the recompute;
- a set of module classes: every module of those classes (outermost only);
- a callable ``(module, qualified_name) -> bool``;
- ``None`` / ``False`` / ``"none"``: off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any, Union

import torch
from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.memory._blocks import find_blocks, inside

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "check_policy",
    "checkpoint_targets",
    "checkpointing_applied",
    "is_checkpointed",
    "policy_name",
]

ActivationCheckpointing = Union[None, bool, str, Collection[type], Callable[[nn.Module, str], bool]]
_NAMES = ("full", "selective", "none")
_SUBCLASSES: dict[type, type] = {}


def check_policy(policy: Any) -> ActivationCheckpointing:
    """``policy`` normalised (``"full"`` -> True, ``"none"``/False -> None), or a clear error.

    Raises:
        ConfigurationError: not one of the kinds listed in this module's docstring.
    """
    if policy is None or policy is False:
        return None
    if policy is True:
        return True
    if isinstance(policy, str):
        key = policy.strip().lower()
        if key in _NAMES:
            return {"full": True, "selective": "selective", "none": None}[key]
    elif callable(policy) and not isinstance(policy, type):
        return policy
    elif isinstance(policy, Collection) and policy and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in policy
    ):
        return frozenset(policy)
    raise ConfigurationError(
        f"activation_checkpointing={policy!r} is not understood; use True (every block), "
        "'selective' (every other block), a set of module classes such as {MyBlock}, a callable "
        "(module, name) -> bool, or None (off)."
    )


def policy_name(policy: ActivationCheckpointing) -> str:
    """``"none"``, ``"full"``, ``"selective"`` or ``"custom"``: for messages and plans."""
    policy = check_policy(policy)
    if policy is None:
        return "none"
    if policy is True:
        return "full"
    return "selective" if policy == "selective" else "custom"


def checkpoint_targets(root: nn.Module, policy: ActivationCheckpointing) -> list[tuple[str, nn.Module]]:
    """The modules ``policy`` checkpoints in ``root``, outermost only, in definition order.

    Raises:
        ConfigurationError: a bad policy, or True/"selective" on a model with no blocks to find.
    """
    policy = check_policy(policy)
    if policy is None:
        return []
    if policy is True or policy == "selective":
        blocks = find_blocks(root)
        if not blocks:
            raise ConfigurationError(
                f"activation_checkpointing={'True' if policy is True else repr(policy)}: found no blocks "
                f"in {type(root).__name__} (blocks are transformer layers, or the elements of a "
                "ModuleList/Sequential of two or more same-class modules with parameters). Name them: "
                "activation_checkpointing={MyBlock}, or a callable (module, name) -> bool."
            )
        return blocks if policy is True else blocks[::2]
    if callable(policy):
        chosen = [(n, m) for n, m in root.named_modules() if m is not root and policy(m, n)]
    else:
        classes = tuple(policy)  # type: ignore[arg-type]
        chosen = [(n, m) for n, m in root.named_modules() if m is not root and isinstance(m, classes)]
    outermost: list[tuple[str, nn.Module]] = []
    names: set[str] = set()
    for name, module in chosen:
        if not inside(name, names):
            outermost.append((name, module))
            names.add(name)
    return outermost


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs under activation checkpointing."""
    return bool(getattr(type(module), "_gpukit_checkpointed", False))


def apply_activation_checkpointing(root: nn.Module, policy: ActivationCheckpointing) -> list[str]:
    """Make the modules ``policy`` selects recompute their activations in backward (in place).

    Call it before wrapping the model (DDP, ``fully_shard``, ``torch.compile``); the session's
    strategies do. Modules already checkpointed are left as they are.

    Returns:
        The qualified names of the checkpointed modules.

    Raises:
        ConfigurationError: see :func:`checkpoint_targets`.
    """
    targets = checkpoint_targets(root, policy)
    for _name, module in targets:
        if not is_checkpointed(module):
            module.__class__ = _checkpointed_class(type(module))
    return [name for name, _ in targets]


@contextlib.contextmanager
def checkpointing_applied(root: nn.Module, policy: ActivationCheckpointing) -> Iterator[list[str]]:
    """Checkpointing applied for the ``with`` body, then the classes put back (the planner's use)."""
    targets = [(n, m, type(m)) for n, m in checkpoint_targets(root, policy)]
    try:
        for _name, module, cls in targets:
            if not is_checkpointed(module):
                module.__class__ = _checkpointed_class(cls)
        yield [name for name, _, _ in targets]
    finally:
        for _name, module, cls in targets:
            module.__class__ = cls


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with a forward that checkpoints (one subclass per class, named like it)."""
    sub = _SUBCLASSES.get(cls)
    if sub is not None:
        return sub

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner = super(sub, self).forward  # type: ignore[arg-type]
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)  # inference: nothing is saved, nothing to recompute
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    sub = type(cls.__name__, (cls,), {
        "forward": forward, "_gpukit_checkpointed": True,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    })
    _SUBCLASSES[cls] = sub
    return sub

