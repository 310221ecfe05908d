"""The Session's training step: backward, gradient accumulation, the optimizer step, and the counts.

:class:`TrainingSteps` counts micro-batches and optimizer steps and knows when a micro-batch ends
an accumulation window. The Session's ``accumulate``, ``backward`` and ``step`` delegate to it;
its memory component (``run_step``, OOM back-off) runs micro-batches through the same object, and
its run state saves and restores the counts -- one object they share instead of each reading the
other's private attributes.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gpukit.precision import Precision
    from gpukit.strategies import Strategy

__all__ = ["TrainingSteps"]


class TrainingSteps:
    """Backward and optimizer steps for ``accumulate_grad_batches`` micro-batches a step.

    Args:
        strategy: skips the gradient sync inside a window (``no_backward_sync``), clips gradients.
        precision: scales the loss (fp16), unscales and steps the optimizer.
        accumulate_grad_batches: micro-batches per optimizer step (checked by the Session).
    """

    def __init__(self, strategy: Strategy, precision: Precision, accumulate_grad_batches: int) -> None:
        self._strategy = strategy
        self._precision = precision
        self.accumulate_grad_batches = accumulate_grad_batches
        self.micro_step = 0
        self.optimizer_steps = 0

    def use_precision(self, precision: Precision) -> None:
        """Scale and step with ``precision`` from now on (``Session(fit=...)`` chose it at setup)."""
        self._precision = precision

    def next_is_boundary(self) -> bool:
        """Whether the micro-batch about to run is the last of its accumulation window."""
        return (self.micro_step + 1) % self.accumulate_grad_batches == 0

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """No gradient sync (DDP, FSDP) except on the last micro-batch of a window."""
        if self.next_is_boundary():
            return contextlib.nullcontext()
        return self._strategy.no_backward_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by ``accumulate_grad_batches`` and scaled for fp16."""
        if self.accumulate_grad_batches > 1:
            # summed over the micro-batches this gives the gradient of the mean loss
            loss = loss / self.accumulate_grad_batches
        self._precision.scale_loss(loss).backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None) -> bool:
        """Count a micro-batch; at the end of a window clip, step and zero the grads (True: it stepped)."""
        self.micro_step += 1
        if self.micro_step % self.accumulate_grad_batches != 0:
            return False
        if clip_grad_norm is not None:
            self._precision.unscale_(optimizer)
            self._strategy.clip_gradients(optimizer, clip_grad_norm)
        stepped = self._precision.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += int(stepped)
        return stepped

    def state_dict(self) -> dict[str, int]:
        """The counts a checkpoint carries."""
        return {"micro_step": self.micro_step, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.micro_step = int(state.get("micro_step", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
