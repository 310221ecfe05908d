"""One tensor-parallel rank's share of a model, as the planner plans it, and what the rank exchanges.

Under tensor parallelism each rank of a group of ``t`` runs the same batch through its shard of every split
layer (:func:`~gpukit.memory.tensor_split`): column-wise linears keep ``out_features / t`` outputs, row-wise
ones ``in_features / t`` inputs (their bias whole), embeddings ``num_embeddings / t`` rows, and attention
``heads / t`` heads. That is a smaller model, which :func:`tensor_shard_model` builds on the meta device
(no memory, no copy of the weights) so that the planner's ordinary simulated step gives a rank's peak,
parameters, gradients, optimizer state and FLOPs. The activations between blocks are whole on every rank, as
they are under torch's ``RowwiseParallel`` (its output is all-reduced to a replicated tensor).

What is not in that step is the traffic: :func:`tensor_traffic` runs the shard model's forward once on meta
tensors of one sample and counts the elements the collectives move (torch's styles, as CommDebugMode sees
them): forward, each row-wise linear's and each embedding's output is all-reduced and each gathered output
head's logits all-gathered; backward, each column-wise linear's (and gathered head's) input gradient is
all-reduced (q, k and v one each: each is its own ``ColwiseParallel``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit.memory._tp_structure import TensorSplit

__all__ = ["TensorTraffic", "tensor_shard_model", "tensor_traffic"]


@dataclass(frozen=True)
class TensorTraffic:
    """Elements one sample's forward+backward moves through a tensor group's collectives (one rank's view).

    Attributes:
        reduced: elements all-reduced (forward and backward together).
        gathered: elements of the whole tensors all-gathered (the gathered output heads' logits).
        collectives: how many collectives one micro-batch runs.
    """

    reduced: int
    gathered: int
    collectives: int


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    copied = torch.empty_like(tensor, device="meta")
    return nn.Parameter(copied, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else copied


def _narrow(module: nn.Module, attr: str, dim: int, degree: int) -> None:
    """Replace ``module.<attr>`` by a meta parameter of ``1 / degree`` of its size along ``dim``."""
    old = getattr(module, attr)
    shape = list(old.shape)
    shape[dim] //= degree
    setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                       requires_grad=old.requires_grad))


def tensor_shard_model(model: nn.Module, split: TensorSplit) -> nn.Module:
    """A meta-device copy of ``model`` as one rank of a tensor group of ``split.degree`` holds it.

    ``model`` is not modified; its weights are not copied (every parameter and buffer becomes a meta tensor of
    its shape first), so this costs the module tree only.
    """
    memo: dict[int, Any] = {id(t): _meta(t) for t in (*model.parameters(), *model.buffers())}
    local = copy.deepcopy(model, memo)
    degree = split.degree
    for name in (*split.column, *split.gathered):
        linear = local.get_submodule(name)
        _narrow(linear, "weight", 0, degree)
        if linear.bias is not None:
            _narrow(linear, "bias", 0, degree)
        linear.out_features //= degree
    for name in split.row:
        linear = local.get_submodule(name)
        _narrow(linear, "weight", 1, degree)
        linear.in_features //= degree
    for name in split.embeddings:
        embedding = local.get_submodule(name)
        _narrow(embedding, "weight", 0, degree)
        embedding.num_embeddings //= degree
    for prefix, attr, value in split.heads:  # attention reshapes by its local head count
        setattr(local.get_submodule(prefix), attr, value)
    return local


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0].numel()
    return 0


def tensor_traffic(local: nn.Module, split: TensorSplit, run: Callable[[nn.Module], Any]) -> TensorTraffic:
    """What one sample moves through the collectives: ``run(local)`` runs the shard model's forward on one
    sample of meta inputs (see the module docstring for what each kind of layer exchanges)."""
    counted = {"reduced": 0, "gathered": 0, "collectives": 0}

    def hook(kind: str) -> Callable[..., None]:
        def count(_module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if kind in ("row", "embedding"):  # forward: the partial output, all-reduced
                counted["reduced"] += _numel(output)
                counted["collectives"] += 1
            if kind in ("column", "gathered"):  # backward: the partial gradient of the input, all-reduced
                counted["reduced"] += _numel(args[0] if args else None)
                counted["collectives"] += 1
            if kind == "gathered":  # forward: the logits, gathered whole
                counted["gathered"] += _numel(output) * split.degree
                counted["collectives"] += 1
        return count

    kinds = {**{n: "column" for n in split.column}, **{n: "row" for n in split.row},
             **{n: "gathered" for n in split.gathered}, **{n: "embedding" for n in split.embeddings}}
    handles = [local.get_submodule(name).register_forward_hook(hook(kind)) for name, kind in kinds.items()]
    try:
        with torch.no_grad():
            run(local)
    finally:
        for handle in handles:
            handle.remove()
    return TensorTraffic(counted["reduced"], counted["gathered"], counted["collectives"])
