"""``FitPlanner``: the plans ``fit`` ranks from -- exact at a micro-batch size (cached), or
interpolated in the batch between two exact ones -- and the helpers that size an example batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from gpukit.errors import ConfigurationError
from gpukit.memory._planner import MemoryEstimate, estimate_memory

__all__ = ["POLICIES", "FitPlanner", "example_batch_size", "resized"]

#: ``fit``'s checkpointing names and the ``activation_checkpointing=`` each one plans with
POLICIES = {"none": None, "selective": "selective", "full": True}


class FitPlanner:
    """``estimate_memory`` at a micro-batch size: exact (cached), or interpolated linearly in the
    batch from two exact plans (activations grow with the batch; the rest does not). One
    planner given to several :func:`fit` calls plans each (precision, checkpointing, size) once."""

    def __init__(self, model: torch.nn.Module, example_input: Any, optimizer: Any, device: str) -> None:
        self.model, self.example, self.optimizer, self.device = model, example_input, optimizer, device
        self._cache: dict[tuple[str, str, int], MemoryEstimate] = {}
        self._full = example_batch_size(example_input)

    @property
    def plans(self) -> int:
        """How many planner runs this planner made (each one traces a training step)."""
        return len(self._cache)

    def exact(self, precision: str, ckpt: str, micro: int) -> MemoryEstimate:
        key = (precision, ckpt, micro)
        if key not in self._cache:
            self._cache[key] = self._plan(key)
        return self._cache[key]

    def _plan(self, key: tuple[str, str, int]) -> MemoryEstimate:
        precision, ckpt, micro = key
        return estimate_memory(self.model, self.optimizer, resized(self.example, micro), precision=precision,
                               device=self.device, activation_checkpointing=POLICIES[ckpt])

    def plan_all(self, keys: Sequence[tuple[str, str, int]], workers: int) -> None:
        """Make the plans of ``keys`` not made yet, in ``workers`` processes side by side."""
        from gpukit.memory._plan_workers import plan_all

        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        self._cache.update(plan_all(missing, self._plan, workers))

    def interpolation_keys(self, precision: str, ckpt: str, micro: int) -> list[tuple[str, str, int]]:
        """The exact plans :meth:`interpolated` takes for ``micro``."""
        big = max(1, self._full)
        small = max(1, big // 4)
        if micro in (big, small) or big == small:
            return [(precision, ckpt, micro)]
        return [(precision, ckpt, small), (precision, ckpt, big)]

    def interpolated(self, precision: str, ckpt: str, micro: int) -> MemoryEstimate:
        keys = self.interpolation_keys(precision, ckpt, micro)
        if len(keys) == 1:
            return self.exact(*keys[0])
        (_, _, small), (_, _, big) = keys
        a, b = self.exact(*keys[0]), self.exact(*keys[1])
        t = (micro - small) / (big - small)

        def lerp(x: int, y: int) -> int:
            return max(0, int(round(x + (y - x) * t)))

        return replace(b, peak_bytes=lerp(a.peak_bytes, b.peak_bytes),
                       activations_bytes=lerp(a.activations_bytes, b.activations_bytes),
                       inputs_bytes=lerp(a.inputs_bytes, b.inputs_bytes), flops=lerp(a.flops, b.flops))


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
