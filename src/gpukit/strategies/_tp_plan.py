"""Tensor-parallel plans: which layers are split, found by the model's structure, and checked
before anything is sharded.

A plan maps module names to torch's ``ParallelStyle`` s (what ``parallelize_module`` takes). The
automatic plan looks at each module's own ``nn.Linear`` / ``nn.Embedding`` children, not at one
model's attribute names:

- **attention**: a module with a head attribute of its own (``head_dim``, ``num_heads``,
  ``n_heads``, ``n_head``, ``num_attention_heads``, ``n_kv_heads``, ``num_key_value_heads`` ...)
  and linears ``H -> heads*d`` (q, k, v: column-wise, so each rank keeps whole heads) and one
  ``heads*d -> H`` (the output: row-wise, its partial sums all-reduced). The head counts come from
  the module (or its ``config``) and must divide by the degree; the module's own integer head
  attributes are set to the local count (a shared ``config`` is left alone: Hugging Face Llama
  reshapes with ``-1`` and needs no change).
- **MLP**: any other module with a linear ``I -> H`` (row-wise) and siblings ``H -> I`` (column-wise:
  Llama's gate and up, a plain up projection); in an ``nn.Sequential`` only when what runs between
  is element-wise (activations, dropout). ``I`` must divide by the degree.
- **embeddings**: ``nn.Embedding`` split over the vocabulary (row-wise: each rank looks up its rows,
  the partial results are all-reduced); an **output head** (a linear ``H -> V`` whose ``V`` is an
  embedding's vocabulary) column-wise with its output gathered. Tied weights are left whole.

Not split (left whole on every rank of the tensor group: correct, no memory saved):
``nn.MultiheadAttention`` (its q/k/v live in one fused parameter), a fused ``qkv`` linear, and
Hugging Face GPT-2's ``Conv1D`` (torch's styles take ``nn.Linear`` and ``nn.Embedding`` only) --
give a plan for such models, e.g. after replacing ``Conv1D`` by ``nn.Linear``.

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

__all__ = ["TensorPlan", "auto_plan", "check_plan", "HEAD_ATTRIBUTES"]

#: module attributes that say "this is attention" and hold head counts (query heads first)
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "nhead")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_ATTENTION_MARKERS = (*HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES, "head_dim", "num_key_value_groups")
#: what may run between an nn.Sequential's up and down projections for the split to stay exact
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.LeakyReLU, nn.ELU, nn.Mish,
                nn.Identity, nn.ReLU6, nn.Softplus, nn.Hardswish)


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


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, c) for n, c in module.named_children() if type(c) is nn.Linear]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _divides(what: str, size: int, degree: int, rule: str) -> None:
    if size % degree:
        raise ConfigurationError(
            f"tensor_parallel={degree} cannot split {what}: {size} is not divisible by {degree} ({rule}). "
            f"Use a tensor_parallel degree that divides {size}, or give a plan that leaves this layer whole "
            "(Session(tensor_parallel=..., tensor_plan={...}))."
        )


def _count(module: nn.Module, names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first integer attribute of ``names`` on the module, else on its ``config`` (owner ``config.``)."""
    for owner, prefix in ((module, ""), (getattr(module, "config", None), "config.")):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return prefix + name, value
    return None


def _attention(prefix: str, module: nn.Module, degree: int, plan: TensorPlan) -> None:
    """Split ``module``'s q/k/v column-wise and its output row-wise (or note why it is left whole).

    The output projection is the last linear registered (q, k, v, o in every attention written so far):
    shapes alone cannot tell q from o when ``heads * head_dim == hidden``.
    """
    linears = _linears(module)
    where = prefix or "<root>"
    if len(linears) < 2:
        return
    (out_name, out), ins = linears[-1], linears[:-1]
    if (ins[0][1].out_features != out.in_features
            or any(c.in_features != out.out_features for _, c in ins)):
        plan.left_whole.append(f"{where} (attention-like, but its linears are not q/k/v then an output)")
        return
    query = _count(module, HEAD_ATTRIBUTES)
    dim = getattr(module, "head_dim", None)
    if query is None and isinstance(dim, int) and dim > 0:
        query = ("out.in_features // head_dim", out.in_features // dim)
    if query is None:
        plan.left_whole.append(f"{where} (attention-like, but no head count: set num_heads)")
        return
    _divides(f"the attention heads of {where!r} ({query[0]} = {query[1]})", query[1], degree,
             "each rank keeps whole heads: the head count must be a multiple of the degree")
    kv = _count(module, KV_HEAD_ATTRIBUTES)
    if kv is not None:
        _divides(f"the key/value heads of {where!r} ({kv[0]} = {kv[1]})", kv[1], degree,
                 "each rank keeps whole key/value heads: their count must be a multiple of the degree")
    for attr in (*HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES):
        value = module.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            plan.heads.append((prefix, attr, value // degree))
    colwise, rowwise = _styles()
    for name, _ in ins:
        plan.styles[_join(prefix, name)] = colwise()
    plan.styles[_join(prefix, out_name)] = rowwise()


def _mlp(prefix: str, module: nn.Module, degree: int, plan: TensorPlan) -> None:
    """Linears ``H -> I`` (column-wise) registered before a linear ``I -> H`` (row-wise) among ``module``'s
    children, unless another child holds a parameter of width ``I`` (a norm over the hidden units, or the
    blocks between a model's input and output layers: then what runs between is not element-wise)."""
    colwise, rowwise = _styles()
    children = list(module.named_children())
    linears = _linears(module)
    for at, (down_name, down) in enumerate(linears):
        ups = [(n, c) for n, c in linears[:at] if c.out_features == down.in_features
               and c.in_features == down.out_features and _join(prefix, n) not in plan.styles]
        if isinstance(module, nn.Sequential):
            # only the projection just before, with element-wise layers between
            index = [n for n, _ in children].index(down_name)
            before = [n for n, c in children[:index] if not isinstance(c, _ELEMENTWISE)]
            ups = [(n, c) for n, c in ups if before and before[-1] == n]
        if not ups or any(type(c) is not nn.Linear and any(down.in_features in p.shape for p in c.parameters())
                          for _, c in children):
            continue
        names = ", ".join(repr(_join(prefix, n)) for n, _ in ups)
        _divides(f"the MLP {names} -> {_join(prefix, down_name)!r} (hidden width {down.in_features})",
                 down.in_features, degree, "each rank keeps hidden_width / degree of the MLP's units")
        for name, _ in ups:
            plan.styles[_join(prefix, name)] = colwise()
        plan.styles[_join(prefix, down_name)] = rowwise()


def _unsupported(name: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.MultiheadAttention):
        return f"{name} (nn.MultiheadAttention: q/k/v in one fused parameter)"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return f"{name} (Hugging Face Conv1D: torch splits nn.Linear and nn.Embedding only)"
    return None


def auto_plan(model: nn.Module, degree: int) -> TensorPlan:
    """The plan found by structure (see the module docstring).

    Raises:
        ConfigurationError: a layer it would split does not divide by ``degree`` (naming the layer, the
            sizes and the rule), or nothing in ``model`` can be split.
    """
    plan = TensorPlan()
    embeddings: dict[int, tuple[str, nn.Embedding]] = {}
    for prefix, module in model.named_modules():
        why = _unsupported(prefix or "<root>", module)
        if why:
            plan.left_whole.append(why)
            continue
        if isinstance(module, nn.Embedding):
            embeddings[id(module)] = (prefix, module)
            continue
        if any(hasattr(module, attr) for attr in _ATTENTION_MARKERS):
            # attention or nothing: split as an MLP, its heads would be reshaped with the wrong width
            _attention(prefix, module, degree, plan)
        else:
            _mlp(prefix, module, degree, plan)
    blocks = dict(plan.styles)
    _embeddings_and_heads(model, list(embeddings.values()), degree, plan)
    if not blocks:  # embeddings alone: the blocks, where the memory is, would all stay whole
        raise ConfigurationError(
            f"tensor_parallel={degree}: found no block to split in {type(model).__name__} (no attention with a "
            "head count, no MLP pair of nn.Linear)"
            + (f"; seen but not splittable: {', '.join(plan.left_whole)}" if plan.left_whole else "")
            + ". Give a plan: Session(tensor_parallel=..., tensor_plan={'name': ColwiseParallel(), ...})."
        )
    return plan


def _embeddings_and_heads(model: nn.Module, embeddings: list[tuple[str, nn.Embedding]], degree: int,
                          plan: TensorPlan) -> None:
    from torch.distributed.tensor import Replicate

    colwise, rowwise = _styles()
    weights = {id(e.weight) for _, e in embeddings}
    vocab = {e.num_embeddings for _, e in embeddings}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name in plan.styles or module.out_features not in vocab:
            continue
        if id(module.weight) in weights:
            plan.left_whole.append(f"{name} (weight tied to an embedding)")
            continue
        _divides(f"the output head {name!r} (out_features = {module.out_features})", module.out_features, degree,
                 "each rank computes out_features / degree of the logits, then they are gathered")
        plan.styles[name] = colwise(output_layouts=Replicate())
    heads = {id(m.weight) for n, m in model.named_modules() if n in plan.styles and type(m) is nn.Linear}
    for name, emb in embeddings:
        uses = sum(p is emb.weight for _, p in model.named_parameters(remove_duplicate=False))
        if id(emb.weight) in heads or uses > 1:
            plan.left_whole.append(f"{name} (weight tied to another layer)")
            continue
        _divides(f"the embedding {name!r} (num_embeddings = {emb.num_embeddings})", emb.num_embeddings, degree,
                 "each rank looks up num_embeddings / degree rows of the table")
        plan.styles[name] = rowwise(input_layouts=Replicate())  # the ids are the same on every rank


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
        matched = [n for n in modules if n == pattern or (n and fnmatch.fnmatchcase(n, pattern))]
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
    _divides(f"{name!r} with {kind} ({what} = {size})", size, degree,
             f"{kind} gives each rank {what} / degree")
