"""``FitPlanner``: the plans ``fit`` ranks from, one per (precision, checkpointing, micro-batch
size, tensor-parallel degree), cached -- and the helpers that size an example batch.

A plan at a tensor-parallel degree above 1 is the plan of one rank's shard of the model
(``_tp_shard.py``): what each rank of the tensor group holds and runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from gpukit.errors import ConfigurationError
from gpukit.memory._planner import MemoryEstimate, estimate_memory
from gpukit.memory._simulate import call_model
from gpukit.memory._tp_shard import TensorTraffic, tensor_shard_model, tensor_traffic
from gpukit.memory._tp_structure import TensorSplit, tensor_split

__all__ = ["POLICIES", "FitPlanner", "example_batch_size", "resized"]

#: ``fit``'s checkpointing names and the ``activation_checkpointing=`` each one plans with
POLICIES = {"none": None, "selective": "selective", "full": True}
#: a plan's key: (precision, checkpointing, micro-batch, tensor-parallel degree)
Key = tuple[str, str, int, int]


class FitPlanner:
    """``estimate_memory`` at a micro-batch size, cached. One planner given to several
    :func:`fit` calls plans each (precision, checkpointing, size) once. ``progress``, when set,
    is called with one line before each plan (or set of plans made side by side)."""

    def __init__(self, model: torch.nn.Module, example_input: Any, optimizer: Any, device: str,
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.example, self.optimizer, self.device = model, example_input, optimizer, device
        self.progress = progress
        self._cache: dict[Key, MemoryEstimate] = {}
        self._splits: dict[int, tuple[TensorSplit, torch.nn.Module]] = {}
        self._traffic: dict[int, TensorTraffic] = {}
        example_batch_size(example_input)  # checked here: every tensor has the batch as dim 0

    @property
    def plans(self) -> int:
        """How many planner runs this planner made (each one traces a training step)."""
        return len(self._cache)

    def planned(self, key: Key) -> bool:
        """Whether the plan of ``(precision, checkpointing, micro-batch, tensor degree)`` is made already."""
        return key in self._cache

    def exact(self, precision: str, ckpt: str, micro: int, tensor: int = 1) -> MemoryEstimate:
        """The plan of one micro-batch (of one rank's shard of the model, when ``tensor > 1``)."""
        key = (precision, ckpt, micro, tensor)
        if key not in self._cache:
            self._say([key])
            self._cache[key] = self._plan(key)
        return self._cache[key]

    def split(self, tensor: int) -> tuple[TensorSplit, torch.nn.Module]:
        """What ``tensor`` splits of the model, and one rank's shard of it (on meta), made once.

        Raises:
            ConfigurationError: the degree does not divide the model (``TensorSplitError``), or nothing splits.
        """
        if tensor not in self._splits:
            found = tensor_split(self.model, tensor)
            self._splits[tensor] = (found, tensor_shard_model(self.model, found))
        return self._splits[tensor]

    def traffic(self, tensor: int) -> TensorTraffic:
        """What one sample moves through the tensor group's collectives (``_tp_shard.tensor_traffic``)."""
        if tensor not in self._traffic:
            found, local = self.split(tensor)
            one = resized(self.example, 1)
            self._traffic[tensor] = tensor_traffic(local, found, lambda m: call_model(m, one))
        return self._traffic[tensor]

    def _say(self, keys: list[Key]) -> None:
        if self.progress is None or not keys:
            return
        tensor = f", tensor x{keys[0][3]}" if keys[0][3] > 1 else ""
        what = (f"{keys[0][0]}, checkpointing {keys[0][1]}, micro-batch {keys[0][2]}{tensor}" if len(keys) == 1
                else f"{len(keys)} configurations")
        self.progress(f"planning {what} ({len(self._cache)} planned so far)")

    def _plan(self, key: Key) -> MemoryEstimate:
        precision, ckpt, micro, tensor = key
        model = self.model if tensor == 1 else self.split(tensor)[1]
        return estimate_memory(model, self.optimizer, resized(self.example, micro), precision=precision,
                               device=self.device, activation_checkpointing=POLICIES[ckpt])

    def plan_all(self, keys: Sequence[Key], workers: int) -> None:
        """Make the plans of ``keys`` not made yet, in ``workers`` processes side by side."""
        from gpukit.memory._plan_workers import plan_all

        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        if workers <= 1 or len(missing) <= 1:
            for key in missing:
                self.exact(*key)
            return
        self._say(missing)
        self._cache.update(plan_all(missing, self._plan, workers, warm=bool(self._cache)))


def example_batch_size(example: Any) -> int:
    """The batch size of an example input: dim 0 of its tensors, which must agree."""
    sizes = {t.shape[0] for t in tree_leaves(example) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ConfigurationError(
            f"fit(example_input=...): every input tensor needs the batch as dim 0 (got batch sizes {sorted(sizes)}); "
            "pass global_batch= to say it.")
    return sizes.pop()


def resized(example: Any, micro: int) -> Any:
    """``example`` with ``micro`` items (dim 0), as meta tensors: only shapes and dtypes are planned."""
    return tree_map(lambda t: torch.empty((micro, *t.shape[1:]), dtype=t.dtype, device="meta")
                    if isinstance(t, torch.Tensor) and t.dim() > 0 else t, example)
