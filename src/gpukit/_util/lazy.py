"""Lazy re-exports (PEP 562) for packages whose public names live in heavier modules.

``gpukit`` and ``gpukit.devices`` use it so that importing them (and so ``gpukit ls``) loads
only what is used: no torch until a torch-backed name is touched.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, namespace: dict[str, Any], owners: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, resolving ``owners[name]`` (a module) on use.

    Args:
        package: the package's ``__name__`` (for error messages).
        namespace: the package's ``globals()``; resolved names are cached there.
        owners: public name -> absolute name of the module that defines it.
    """

    def getattr_(name: str) -> Any:
        module_name = owners.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(owners))

    return getattr_, dir_
