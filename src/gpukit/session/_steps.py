"""The Session's step counter: micro-batches, optimizer steps and the accumulation boundary.

One small object that the Session, its memory component (OOM back-off needs to know whether the
next micro-batch ends an accumulation window) and its run state (checkpoints carry the counts)
share, instead of each reading the other's private attributes.
"""

from __future__ import annotations

__all__ = ["StepCounter"]


class StepCounter:
    """Counts micro-batches and optimizer steps for ``accumulate_grad_batches`` micro-batches a step."""

    __slots__ = ("accumulate_grad_batches", "micro_step", "optimizer_steps")

    def __init__(self, accumulate_grad_batches: int) -> None:
        self.accumulate_grad_batches = accumulate_grad_batches
        self.micro_step = 0
        self.optimizer_steps = 0

    def next_is_boundary(self) -> bool:
        """Whether the micro-batch about to run is the last of its accumulation window."""
        return (self.micro_step + 1) % self.accumulate_grad_batches == 0

    def count_micro_batch(self) -> bool:
        """Count one micro-batch; True when it closed an accumulation window (time to step)."""
        self.micro_step += 1
        return self.micro_step % self.accumulate_grad_batches == 0

    def state_dict(self) -> dict[str, int]:
        return {"micro_step": self.micro_step, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.micro_step = int(state.get("micro_step", 0))  # type: ignore[call-overload]
        self.optimizer_steps = int(state.get("optimizer_steps", 0))  # type: ignore[call-overload]
