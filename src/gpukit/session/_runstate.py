"""The run-state component of :class:`gpukit.Session`: stopping together, and the session's own
state that checkpoints carry.

The Session holds one :class:`RunState` and delegates ``should_stop``, ``save_checkpoint``,
``resume``, ``state_dict`` and ``load_state_dict`` to it. ``should_stop`` turns a stop request (SIGTERM/SIGINT caught by
:mod:`gpukit.worker`) into one answer on every rank; the state is the step counter,
the precision's (GradScaler) state and the micro-batch size OOM back-off settled on.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gpukit.precision import Precision
    from gpukit.session._memory import SessionMemory
    from gpukit.session._steps import TrainingSteps
    from gpukit.strategies import Strategy

__all__ = ["RunState"]


class RunState:
    """Stop agreement and session state (see the module docstring).

    Args:
        strategy, precision: the Session's.
        steps: the Session's step counter (saved and restored).
        memory: the Session's memory component (its back-off micro-batch size is saved).
    """

    def __init__(self, *, strategy: Strategy, precision: Precision, steps: TrainingSteps,
                 memory: SessionMemory) -> None:
        self._strategy = strategy
        self._precision = precision
        self._steps = steps
        self._memory = memory

    def use_precision(self, precision: Precision) -> None:
        """Save and restore ``precision``'s state (``Session(fit=...)`` chose it at setup)."""
        self._precision = precision

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop; every rank gets the same answer (one all-reduce)."""
        from gpukit.worker import mark_stop_agreed, stop_requested

        stop = stop_requested()
        strategy = self._strategy
        if strategy.world_size > 1 and strategy.launched:
            flag = torch.tensor(1.0 if stop else 0.0, device=strategy.root_device)
            stop = bool(strategy.all_reduce(flag, op="max") > 0)
        if stop:
            mark_stop_agreed(strategy.rank)  # gpukit run exits 75 even if only one rank got it
        return stop

    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, *, keep_last: int = 3,
        extra: dict[str, Any] | None = None, **objects: Any,
    ) -> Any:
        """Save ``step`` with ``objects`` and this state under the name ``session`` (every rank)."""
        from gpukit.checkpoint import CheckpointManager

        return CheckpointManager(directory, keep_last=keep_last).save(step, extra=extra, session=self, **objects)

    def resume(self, directory: str | os.PathLike[str], **objects: Any) -> int | None:
        """Restore ``objects`` and this state from the latest complete checkpoint in ``directory``."""
        from gpukit.checkpoint import CheckpointManager

        return CheckpointManager(directory).resume(session=self, **objects)

    def state_dict(self) -> dict[str, Any]:
        backoff = self._memory.oom_backoff
        return {
            **self._steps.state_dict(),
            "precision": self._precision.state_dict(),
            "oom_micro_batch_size": backoff.micro_batch_size if backoff else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.load_state_dict(state)
        self._precision.load_state_dict(state.get("precision", {}))
        self._memory.restore_backoff(state.get("oom_micro_batch_size"))
