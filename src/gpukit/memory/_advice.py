"""What to change when a step runs out of memory, with the planner's predicted saving of each.

The generic list ("lower the batch, bf16, activation checkpointing...") becomes concrete: the
step's model and batch are planned (:func:`estimate_memory`, fake tensors: nothing is allocated)
as they are and with each change, and the changes are listed by the memory they save.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_map

from gpukit._util.units import format_bytes
from gpukit.errors import GpukitError
from gpukit.memory._activation import checkpoint_targets, policy_name

__all__ = ["planned_fixes"]

log = logging.getLogger("gpukit.memory")


def planned_fixes(model: torch.nn.Module, batch: Any, *, precision: str, activation_checkpointing: Any = None,
                  device: str | torch.device = "cuda", smaller_batch: bool = True) -> str | None:
    """Concrete fixes for an out-of-memory step, each with its planned saving; ``None`` when the
    model cannot be planned with ``batch`` (the caller keeps its generic list then).

    Args:
        model: the plain model the step ran.
        batch: the step's batch: a tensor (``model(batch)``), a dict (``model(**batch)``), or a
            tuple/list whose first element is the model's input (``(x, y)``).
        precision: the session's precision name.
        activation_checkpointing: the policy already in use (not suggested again).
        device: the device the step ran on.
        smaller_batch: also list half the batch (not when the caller is already halving it).
    """
    from gpukit.memory._planner import estimate_memory

    example = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    example = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t,
                       example)
    size = _length(example)
    device_type = torch.device(device).type

    def peak(**changes: Any) -> int:
        settings = {"precision": precision, "activation_checkpointing": activation_checkpointing, "example": example}
        settings.update(changes)
        return estimate_memory(model, None, settings["example"], precision=settings["precision"], device=device_type,
                               activation_checkpointing=settings["activation_checkpointing"]).peak_bytes

    try:
        now = peak()
        options: list[tuple[int, str]] = []
        if policy_name(activation_checkpointing) != "full" and _has_blocks(model):
            options.append((peak(activation_checkpointing=True), "Session(activation_checkpointing=True)"))
        if precision == "32-true":
            options.append((peak(precision="bf16-mixed"), "Session(precision='bf16-mixed')"))
        if precision in ("32-true", "bf16-mixed"):
            options.append((peak(precision="bf16-true"), "Session(precision='bf16-true') (bf16 weights, "
                                                         "no fp32 master copy)"))
        if smaller_batch and size is not None and size >= 2:
            half = tree_map(lambda t: t[: size // 2] if isinstance(t, torch.Tensor) and t.dim() else t, example)
            options.append((peak(example=half), f"a batch of {size // 2} (Session(oom='backoff') or "
                                                "accumulate_grad_batches=2 keeps the effective batch)"))
    except (GpukitError, RuntimeError, TypeError, ValueError) as exc:
        log.debug("planned_fixes: the step cannot be planned (%s)", exc)
        return None
    options = sorted((p, what) for p, what in options if p < now)
    if not options:
        return None
    lines = [f"Fixes, planned for this model and batch (forward+backward {format_bytes(now)} now; "
             "gpukit plan --fit ranks whole configurations):"]
    lines += [f"  {what}: saves {format_bytes(now - p)} (-> {format_bytes(p)})" for p, what in options]
    return "\n".join(lines)


def _has_blocks(model: torch.nn.Module) -> bool:
    try:
        return bool(checkpoint_targets(model, True))
    except GpukitError:
        return False


def _length(example: Any) -> int | None:
    from torch.utils._pytree import tree_leaves

    sizes = {t.shape[0] for t in tree_leaves(example) if isinstance(t, torch.Tensor) and t.dim()}
    return sizes.pop() if len(sizes) == 1 else None
