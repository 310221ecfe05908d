"""Tensor-parallel plans: which layers are split, found by the model's structure, and checked
before anything is sharded.

A plan maps module names to torch's ``ParallelStyle`` s (what ``parallelize_module`` takes). The
automatic plan is :func:`gpukit.memory.tensor_split`'s finding (attention with its heads split, MLP
pairs, embeddings and output heads, by structure; the rules are in that module, which the planner
reads too) given torch's styles: column-wise and row-wise linears, output heads column-wise with their
output gathered, embeddings row-wise over the vocabulary.

A user's plan (``{"blocks.*.mlp.fc1": ColwiseParallel(), ...}``, names may use ``*`` as
``parallelize_module`` does) is checked the same way: every name must match a module, column- and
row-wise styles take ``nn.Linear`` / ``nn.Embedding`` only, and the split dimension must divide.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gpukit.errors import ConfigurationError
from gpukit.memory import check_divides, tensor_split

__all__ = ["TensorPlan", "auto_plan", "check_plan"]


@dataclass
class TensorPlan:
    """A checked plan: what ``parallelize_module`` gets, and what else set-up changes.

    Attributes:
        styles: module name -> ``ParallelStyle``.
        heads: (module name, attribute, local value) to set on attention modules.
        left_whole: "name (why)" for layers the automatic plan saw and did not split.
    """

    styles: dict[str, Any] = field(default_factory=dict)
    heads: list[tuple[str, str, int]] = field(default_factory=list)
    left_whole: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """``"6 layers split"`` (and what was left whole)."""
        text = f"{len(self.styles)} layer(s) split"
        return text + (f"; left whole: {', '.join(self.left_whole)}" if self.left_whole else "")


def _styles() -> Any:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def auto_plan(model: nn.Module, degree: int) -> TensorPlan:
    """The plan found by structure (:func:`gpukit.memory.tensor_split`), in torch's styles.

    Raises:
        ConfigurationError: a layer it would split does not divide by ``degree`` (naming the layer, the
            sizes and the rule), or nothing in ``model`` can be split.
    """
    from torch.distributed.tensor import Replicate

    colwise, rowwise = _styles()
    split = tensor_split(model, degree)
    styles: dict[str, Any] = {name: colwise() for name in split.column}
    styles.update({name: rowwise() for name in split.row})
    styles.update({name: colwise(output_layouts=Replicate()) for name in split.gathered})
    # the ids are the same on every rank of the group
    styles.update({name: rowwise(input_layouts=Replicate()) for name in split.embeddings})
    return TensorPlan(styles, list(split.heads), list(split.left_whole))


def check_plan(model: nn.Module, styles: dict[str, Any], degree: int) -> TensorPlan:
    """A user's plan, checked before anything is sharded.

    Raises:
        ConfigurationError: a name that matches no module, a value that is not a ``ParallelStyle``, a
            column-/row-wise style on a module other than ``nn.Linear`` / ``nn.Embedding``, or a split
            dimension that does not divide by ``degree``.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    colwise, rowwise = _styles()
    if not isinstance(styles, dict) or not styles:
        raise ConfigurationError(
            f"tensor_plan={styles!r}: give a dict of module name -> ParallelStyle, e.g. "
            "{'mlp.fc1': ColwiseParallel(), 'mlp.fc2': RowwiseParallel()}."
        )
    modules = dict(model.named_modules())
    for pattern, style in styles.items():
        if not isinstance(style, ParallelStyle):
            raise ConfigurationError(
                f"tensor_plan[{pattern!r}] = {style!r}: a plan's values are torch ParallelStyles "
                "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...))."
            )
        matched = [n for n in modules if _matches(n, pattern)]
        if not matched:
            near = [n for n in modules if n and n.split(".")[-1] == str(pattern).split(".")[-1]][:5]
            raise ConfigurationError(
                f"tensor_plan names {pattern!r}, but {type(model).__name__} has no such module"
                + (f" (did you mean {', '.join(map(repr, near))}?)" if near else "")
                + "; names are those of model.named_modules() ('*' matches one level)."
            )
        if not isinstance(style, (colwise, rowwise)):
            continue
        for name in matched:
            _check_split(name, modules[name], style, isinstance(style, colwise), degree)
    return TensorPlan(styles=dict(styles))


def _matches(name: str, pattern: Any) -> bool:
    """Whether ``parallelize_module`` applies ``pattern`` to the module ``name``: it matches one dotted part at
    a time (``"*.fc1"`` is ``a.fc1``, never ``a.b.fc1``), where a plain ``fnmatch`` lets ``*`` cross dots."""
    if name == pattern:
        return True
    if not name or not isinstance(pattern, str) or not pattern:
        return False
    parts, tokens = name.split("."), pattern.split(".")
    return len(parts) == len(tokens) and all(fnmatch.fnmatchcase(p, t) for p, t in zip(parts, tokens))


def _check_split(name: str, module: nn.Module, style: Any, column: bool, degree: int) -> None:
    kind = type(style).__name__
    if type(module) is nn.Linear:
        size, what = (module.out_features, "out_features") if column else (module.in_features, "in_features")
    elif type(module) is nn.Embedding:
        size, what = (module.embedding_dim, "embedding_dim") if column else (module.num_embeddings, "num_embeddings")
    else:
        raise ConfigurationError(
            f"tensor_plan[{name!r}] = {kind}(), but {name!r} is a {type(module).__name__}: torch's {kind} splits "
            "nn.Linear and nn.Embedding only. Name the nn.Linear layers inside it, or leave it out of the plan."
        )
    check_divides(f"{name!r} with {kind} ({what} = {size})", size, degree, f"{kind} gives each rank {what} / degree")
