"""Which layers tensor parallelism splits, found by the model's structure -- shared by the strategy that
splits them (``gpukit.strategies``, which turns each kind into torch's ``ParallelStyle``) and the planner
(``fit``: whether a degree divides the model, the shard each rank keeps, the activations it all-reduces).

It looks at each module's own ``nn.Linear`` / ``nn.Embedding`` children, not at one model's attribute names:

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
Hugging Face GPT-2's ``Conv1D`` (torch's styles take ``nn.Linear`` and ``nn.Embedding`` only).

Imports torch's ``nn`` only (not ``torch.distributed``): the planner reads it where no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from gpukit.errors import ConfigurationError

__all__ = ["TensorSplit", "TensorSplitError", "tensor_split", "check_divides", "HEAD_ATTRIBUTES"]

#: module attributes that say "this is attention" and hold head counts (query heads first)
HEAD_ATTRIBUTES = ("num_heads", "n_heads", "n_head", "num_attention_heads", "nhead")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_ATTENTION_MARKERS = (*HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES, "head_dim", "num_key_value_groups")
#: what may run between an nn.Sequential's up and down projections for the split to stay exact
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.LeakyReLU, nn.ELU, nn.Mish,
                nn.Identity, nn.ReLU6, nn.Softplus, nn.Hardswish)


class TensorSplitError(ConfigurationError):
    """A layer that does not divide by the tensor-parallel degree.

    Attributes:
        reason: the short form (``"12 heads of 'blocks.0.attn' not divisible by 5"``), for the planner's lines.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class TensorSplit:
    """Which modules a degree splits, by kind, in the order found.

    Attributes:
        degree: the tensor-parallel degree.
        column: ``nn.Linear`` s split over their outputs (q/k/v, MLP up projections); output stays split.
        row: ``nn.Linear`` s split over their inputs (attention output, MLP down): output all-reduced.
        gathered: output heads split over their outputs, whose output is gathered whole.
        embeddings: ``nn.Embedding`` s split over their rows (vocabulary): output all-reduced.
        heads: (module name, attribute, local value) to set on attention modules.
        blocks: ``(what, module, size)`` of each block split: ``("heads", "x", 12)``, ``("MLP width", "y", 3072)``.
        left_whole: ``"name (why)"`` for layers seen and not split.
    """

    degree: int
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    gathered: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)
    heads: list[tuple[str, str, int]] = field(default_factory=list)
    blocks: list[tuple[str, str, int]] = field(default_factory=list)
    left_whole: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Every module split."""
        return [*self.column, *self.row, *self.gathered, *self.embeddings]


def _linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, c) for n, c in module.named_children() if type(c) is nn.Linear]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_divides(what: str, size: int, degree: int, rule: str, short: str | None = None) -> None:
    """Refuse a split whose ``size`` does not divide by ``degree``.

    Args:
        what: the layer and dimension (``"the attention heads of 'attn' (num_heads = 12)"``).
        size, degree: the dimension and the tensor-parallel degree.
        rule: why it must divide.
        short: the short reason for the planner (default: ``"<what>: <size> not divisible by <degree>"``).

    Raises:
        TensorSplitError: ``size % degree != 0``.
    """
    if size % degree:
        raise TensorSplitError(
            f"tensor_parallel={degree} cannot split {what}: {size} is not divisible by {degree} ({rule}). "
            f"Use a tensor_parallel degree that divides {size}, or give a plan that leaves this layer whole "
            "(Session(tensor_parallel=..., tensor_plan={...})).",
            short or f"{what}: {size} not divisible by {degree}",
        )


def _count(module: nn.Module, names: tuple[str, ...]) -> tuple[str, int] | None:
    """The first integer attribute of ``names`` on the module, else on its ``config`` (owner ``config.``)."""
    for owner, prefix in ((module, ""), (getattr(module, "config", None), "config.")):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return prefix + name, value
    return None


def _attention(prefix: str, module: nn.Module, split: TensorSplit) -> None:
    """Split ``module``'s q/k/v column-wise and its output row-wise (or note why it is left whole).

    The output projection is the last linear registered (q, k, v, o in every attention written so far):
    shapes alone cannot tell q from o when ``heads * head_dim == hidden``.
    """
    linears = _linears(module)
    where, degree = prefix or "<root>", split.degree
    if len(linears) < 2:
        return
    (out_name, out), ins = linears[-1], linears[:-1]
    if (ins[0][1].out_features != out.in_features
            or any(c.in_features != out.out_features for _, c in ins)):
        split.left_whole.append(f"{where} (attention-like, but its linears are not q/k/v then an output)")
        return
    query = _count(module, HEAD_ATTRIBUTES)
    dim = getattr(module, "head_dim", None)
    if query is None and isinstance(dim, int) and dim > 0:
        query = ("out.in_features // head_dim", out.in_features // dim)
    if query is None:
        split.left_whole.append(f"{where} (attention-like, but no head count: set num_heads)")
        return
    check_divides(f"the attention heads of {where!r} ({query[0]} = {query[1]})", query[1], degree,
                  "each rank keeps whole heads: the head count must be a multiple of the degree",
                  f"{query[1]} heads ({where!r}) not divisible by {degree}")
    kv = _count(module, KV_HEAD_ATTRIBUTES)
    if kv is not None:
        check_divides(f"the key/value heads of {where!r} ({kv[0]} = {kv[1]})", kv[1], degree,
                      "each rank keeps whole key/value heads: their count must be a multiple of the degree",
                      f"{kv[1]} key/value heads ({where!r}) not divisible by {degree}")
    for attr in (*HEAD_ATTRIBUTES, *KV_HEAD_ATTRIBUTES):
        value = module.__dict__.get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            split.heads.append((prefix, attr, value // degree))
    split.column += [_join(prefix, name) for name, _ in ins]
    split.row.append(_join(prefix, out_name))
    split.blocks.append(("heads", where, query[1]))


def _mlp(prefix: str, module: nn.Module, split: TensorSplit) -> None:
    """Linears ``H -> I`` (column-wise) registered before a linear ``I -> H`` (row-wise) among ``module``'s
    children, unless another child holds a parameter of width ``I`` (a norm over the hidden units, or the
    blocks between a model's input and output layers: then what runs between is not element-wise)."""
    children = list(module.named_children())
    linears = _linears(module)
    for at, (down_name, down) in enumerate(linears):
        ups = [(n, c) for n, c in linears[:at] if c.out_features == down.in_features
               and c.in_features == down.out_features and _join(prefix, n) not in split.names]
        if isinstance(module, nn.Sequential):
            # only the projection just before, with element-wise layers between
            index = [n for n, _ in children].index(down_name)
            before = [n for n, c in children[:index] if not isinstance(c, _ELEMENTWISE)]
            ups = [(n, c) for n, c in ups if before and before[-1] == n]
        if not ups or any(type(c) is not nn.Linear and any(down.in_features in p.shape for p in c.parameters())
                          for _, c in children):
            continue
        names = ", ".join(repr(_join(prefix, n)) for n, _ in ups)
        where = _join(prefix, down_name)
        check_divides(f"the MLP {names} -> {where!r} (hidden width {down.in_features})",
                      down.in_features, split.degree, "each rank keeps hidden_width / degree of the MLP's units",
                      f"MLP width {down.in_features} ({where!r}) not divisible by {split.degree}")
        split.column += [_join(prefix, n) for n, _ in ups]
        split.row.append(where)
        split.blocks.append(("MLP width", where, down.in_features))


def _unsupported(name: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.MultiheadAttention):
        return f"{name} (nn.MultiheadAttention: q/k/v in one fused parameter)"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return f"{name} (Hugging Face Conv1D: torch splits nn.Linear and nn.Embedding only)"
    return None


def tensor_split(model: nn.Module, degree: int) -> TensorSplit:
    """What ``degree`` splits of ``model``, found by structure (see the module docstring).

    Raises:
        TensorSplitError: a layer it would split does not divide by ``degree`` (naming the layer, the sizes and
            the rule).
        ConfigurationError: nothing in ``model`` can be split.
    """
    split = TensorSplit(degree)
    embeddings: list[tuple[str, nn.Embedding]] = []
    for prefix, module in model.named_modules():
        why = _unsupported(prefix or "<root>", module)
        if why:
            split.left_whole.append(why)
            continue
        if isinstance(module, nn.Embedding):
            embeddings.append((prefix, module))
            continue
        if any(hasattr(module, attr) for attr in _ATTENTION_MARKERS):
            # attention or nothing: split as an MLP, its heads would be reshaped with the wrong width
            _attention(prefix, module, split)
        else:
            _mlp(prefix, module, split)
    if not split.blocks:  # embeddings alone: the blocks, where the memory is, would all stay whole
        raise ConfigurationError(
            f"tensor_parallel={degree}: found no block to split in {type(model).__name__} (no attention with a "
            "head count, no MLP pair of nn.Linear)"
            + (f"; seen but not splittable: {', '.join(split.left_whole)}" if split.left_whole else "")
            + ". Give a plan: Session(tensor_parallel=..., tensor_plan={'name': ColwiseParallel(), ...})."
        )
    _embeddings_and_heads(model, embeddings, split)
    return split


def _embeddings_and_heads(model: nn.Module, embeddings: list[tuple[str, nn.Embedding]], split: TensorSplit) -> None:
    weights = {id(e.weight) for _, e in embeddings}
    vocab = {e.num_embeddings for _, e in embeddings}
    taken = set(split.names)
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name in taken or module.out_features not in vocab:
            continue
        if id(module.weight) in weights:
            split.left_whole.append(f"{name} (weight tied to an embedding)")
            continue
        check_divides(f"the output head {name!r} (out_features = {module.out_features})", module.out_features,
                      split.degree, "each rank computes out_features / degree of the logits, then they are gathered",
                      f"output head {name!r} ({module.out_features} outputs) not divisible by {split.degree}")
        split.gathered.append(name)
    heads = {id(m.weight) for n, m in model.named_modules() if n in split.gathered}
    for name, emb in embeddings:
        uses = sum(p is emb.weight for _, p in model.named_parameters(remove_duplicate=False))
        if id(emb.weight) in heads or uses > 1:
            split.left_whole.append(f"{name} (weight tied to another layer)")
            continue
        check_divides(f"the embedding {name!r} (num_embeddings = {emb.num_embeddings})", emb.num_embeddings,
                      split.degree, "each rank looks up num_embeddings / degree rows of the table",
                      f"embedding {name!r} ({emb.num_embeddings} rows) not divisible by {split.degree}")
        split.embeddings.append(name)
