"""torch.compile under each strategy: compile what the strategy built, in place.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) around the model. A strategy
that wraps the model itself (DDP) or shards it (FSDP2) must work on the plain model, so
``session.setup`` used to unwrap it -- and the compilation was silently lost. Instead:

- the compile settings are taken from ``Session(compile=True | {...})`` or from the user's
  ``torch.compile(model)`` (its dynamo context, so backend / mode / options are the user's);
- the strategy wraps the plain model as usual;
- then what the strategy names in :meth:`Strategy.compile_targets` is compiled **in place**
  (``module.compile()``): the DDP wrapper (dynamo's DDPOptimizer splits graphs at the gradient
  buckets, so communication still overlaps backward), each FSDP2 unit after ``fully_shard``
  (FSDP's hooks run outside the graphs), the model itself on one device.

Compiling in place keeps the module and its state-dict keys: checkpoints have no
``_orig_mod.`` and load into the plain model.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["CompileRequest", "check_compile", "compile_request", "compile_module", "is_compiled_wrapper", "COMPILE_OPTIONS"]

#: the keyword arguments of torch.compile that Session(compile={...}) accepts
COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def _optimized_module_type() -> type | None:
    # torch.compile(model) imports torch._dynamo.eval_frame before it can return a wrapper: when
    # the module is not loaded, no model is compiled, and importing dynamo (1-2 s) to find that
    # out would make every Session.setup pay for it
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled_wrapper(model: Any) -> bool:
    """Whether ``model`` is what ``torch.compile(model)`` returned."""
    kind = _optimized_module_type()
    return kind is not None and isinstance(model, kind)


@dataclass(frozen=True)
class CompileRequest:
    """How to compile: ``torch.compile`` keyword arguments, or the dynamo context of a user's compile."""

    options: dict[str, Any] = field(default_factory=dict)
    context: Any = None
    source: str = "Session(compile=True)"

    def apply(self, module: nn.Module) -> None:
        """Compile ``module``'s call in place (as ``module.compile()`` does)."""
        if self.context is not None:  # the user's own torch.compile(...) settings
            module._compiled_call_impl = self.context(module._call_impl)  # type: ignore[assignment]
        else:
            module.compile(**self.options)


def check_compile(compile: Any) -> dict[str, Any] | None:
    """``Session(compile=...)`` as torch.compile keyword arguments, or None for no compilation."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, dict):
        unknown = sorted(set(map(str, compile)) - set(COMPILE_OPTIONS))
        if unknown:
            raise ConfigurationError(
                f"compile={compile!r}: unknown option(s) {', '.join(unknown)}; torch.compile options allowed "
                f"here: {', '.join(COMPILE_OPTIONS)} (e.g. compile={{'mode': 'max-autotune'}}).")
        return dict(compile)
    raise ConfigurationError(f"compile={compile!r}; use True, False, or a dict of torch.compile options "
                             f"({', '.join(COMPILE_OPTIONS)}).")


def compile_request(model: nn.Module, compile: dict[str, Any] | None) -> tuple[nn.Module, CompileRequest | None]:
    """The model to set up (a ``torch.compile`` wrapper taken off) and how to compile it after.

    Args:
        model: what the user gave ``session.setup``; maybe ``torch.compile(model)``.
        compile: the checked ``Session(compile=...)`` options, or None.
    """
    user_compiled = is_compiled_wrapper(model)
    inner = model._orig_mod if user_compiled else model  # type: ignore[union-attr]
    if compile is not None:
        return inner, CompileRequest(options=compile)  # Session(compile=...) decides; compiled once
    if user_compiled:
        return inner, CompileRequest(context=model.dynamo_ctx, source="torch.compile(model) before session.setup")
    return model, None


def compile_module(strategy: Any, module: nn.Module, request: CompileRequest | None) -> nn.Module:
    """Compile, in place, the parts of the set-up ``module`` that ``strategy`` names.

    Raises:
        ConfigurationError: ``Session(compile=...)`` under a strategy that cannot compile.
    """
    if request is None:
        return module
    try:
        targets = strategy.compile_targets(module)
    except ConfigurationError as exc:
        if request.context is None:
            raise
        warnings.warn(f"gpukit: {request.source} is not kept: {exc}", stacklevel=3)
        return module
    for target in targets:
        request.apply(target)
    return module
