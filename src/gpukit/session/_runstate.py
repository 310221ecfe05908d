"""Session methods for a run's life across stops: preemption, checkpoints, session state.

Kept apart from ``session.py`` so the facade stays short; :class:`gpukit.Session` inherits
:class:`SessionRunStateMixin`. Each method is a thin delegation to ``gpukit.launch`` (the stop
flag) or ``gpukit.checkpoint`` (the CheckpointManager).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["SessionRunStateMixin"]


class SessionRunStateMixin:
    """Preemption (``should_stop``), checkpoints (``save_checkpoint``, ``resume``) and the
    session's own state (``state_dict``, ``load_state_dict``) that checkpoints carry."""

    # provided by Session and its memory mixin
    strategy: Any
    precision: Any
    _micro_step: int
    _optimizer_steps: int
    _backoff: Any
    world_size: int
    device: torch.device

    @property
    def should_stop(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM/SIGINT under ``gpukit run``: preemption).

        Check it once per step, after ``session.step``; every rank gets the same answer at the
        same step (one small all-reduce), so all ranks can save a checkpoint and leave the loop
        together. ``gpukit run`` then exits with ``gpukit.launch.PREEMPTED_EXIT_CODE`` (75).
        A Session catches SIGTERM everywhere (and SIGINT under a launcher: gpukit run, torchrun).
        """
        from gpukit.launch._preemption import mark_stop_agreed, stop_requested

        stop = stop_requested()
        if self.world_size > 1 and self.strategy.launched:
            flag = torch.tensor(1.0 if stop else 0.0, device=self.device)
            stop = bool(self.strategy.all_reduce(flag, op="max") > 0)
        if stop:
            mark_stop_agreed(self.strategy.rank)  # gpukit run exits 75 even if only one rank got it
        return stop

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, *, keep_last: int = 3,
        extra: dict[str, Any] | None = None, **objects: Any,
    ) -> Any:
        """Save the full training state of ``step`` (call on every rank; rank 0 writes shared state).

        ``objects`` are models, optimizers, schedulers and loaders by name; the session's own
        state (GradScaler, step counters) and every rank's RNG and loader position are added.
        See :class:`gpukit.CheckpointManager`. Returns the step directory written.
        """
        from gpukit.checkpoint import CheckpointManager

        return CheckpointManager(directory, keep_last=keep_last).save(
            step, extra=extra, session=self, **objects
        )

    def resume(self, directory: str | os.PathLike[str], **objects: Any) -> int | None:
        """Restore ``objects`` and this session from the latest complete checkpoint.

        Returns:
            The step it resumed from, or ``None`` when ``directory`` has no checkpoint yet.
        """
        from gpukit.checkpoint import CheckpointManager

        return CheckpointManager(directory).resume(session=self, **objects)

    def state_dict(self) -> dict[str, Any]:
        """Session-owned training state: micro-step, optimizer steps, GradScaler, and the
        micro-batch size OOM back-off settled on (so a resumed run does not run out again)."""
        return {
            "micro_step": self._micro_step,
            "optimizer_steps": self._optimizer_steps,
            "precision": self.precision.state_dict(),
            "oom_micro_batch_size": self._backoff.micro_batch_size if self._backoff else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._micro_step = int(state.get("micro_step", 0))
        self._optimizer_steps = int(state.get("optimizer_steps", 0))
        self.precision.load_state_dict(state.get("precision", {}))
        self._restore_backoff(state.get("oom_micro_batch_size"))
