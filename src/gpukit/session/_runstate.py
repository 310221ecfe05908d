"""The run-state component of :class:`gpukit.Session`: stopping together, and the session's own
state that checkpoints carry.

The Session holds one :class:`RunState` and delegates ``should_stop``, ``save_checkpoint``,
``resume``, ``state_dict`` and ``load_state_dict`` to it. ``should_stop`` turns a stop request (SIGTERM/SIGINT caught by
:mod:`gpukit.worker`) into one answer on every rank; the state is the step counter,
the precision's (GradScaler) state, the micro-batch size OOM back-off settled on and the schedulers
of ``setup_scheduler``. ``resume`` keeps what it did in ``resumed`` and says it on rank 0.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from gpukit.errors import CheckpointError
from gpukit.session._resume import ResumeInfo, loader_position, resume_line

if TYPE_CHECKING:
    from gpukit.session._memory import SessionMemory
    from gpukit.session._schedulers import SessionScheduler
    from gpukit.session._steps import TrainingSteps
    from gpukit.strategies import Strategy

__all__ = ["RunState"]


class RunState:
    """Stop agreement and session state (see the module docstring).

    Args:
        strategy: the Session's (its precision's state is saved and restored).
        steps: the Session's step counter (saved and restored).
        memory: the Session's memory component (its back-off micro-batch size is saved).
    """

    def __init__(self, *, strategy: Strategy, steps: TrainingSteps, memory: SessionMemory,
                 verbose: bool = False) -> None:
        self._strategy = strategy
        self._steps = steps
        self._memory = memory
        self._verbose = verbose
        #: schedulers of ``session.setup_scheduler``, saved and restored with the session's state
        self.schedulers: list[SessionScheduler] = []
        #: what the last ``resume`` did (``session.resumed``)
        self.resumed: ResumeInfo | None = None
        self._stop_read: tuple[torch.Tensor, Any] | None = None  # the last call's agreement, on its way to the host

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop; every rank gets the same answer (one all-reduce).

        On a device that is not the host the answer comes one call late, without a sync: each call
        starts reducing its flag and copying the result back asynchronously, and returns the previous
        call's result (every rank makes the same calls, so every rank gets the same answer at the same
        call); it waits only if the device has not finished that copy since the previous call."""
        from gpukit.worker import mark_stop_agreed, stop_requested

        stop = stop_requested()
        strategy = self._strategy
        if strategy.world_size > 1 and strategy.launched:
            if strategy.accelerator.is_host:
                flag = torch.tensor(1.0 if stop else 0.0, device=strategy.root_device)
                stop = bool(strategy.all_reduce(flag, op="max") > 0)
            else:
                stop = self._agreed_a_call_late(stop)
        if stop:
            mark_stop_agreed(strategy.rank)  # gpukit run exits 75 even if only one rank got it
        return stop

    def _agreed_a_call_late(self, stop: bool) -> bool:
        strategy = self._strategy
        accelerator = strategy.accelerator
        flag = torch.full((), 1.0 if stop else 0.0, device=strategy.root_device)  # a fill: no copy from the host
        reduced = strategy.all_reduce(flag, op="max")
        previous, self._stop_read = self._stop_read, accelerator.to_host_async(reduced)
        if previous is None:
            return False
        host, event = previous
        if event is not None and not accelerator.event_done(event):
            accelerator.wait_event(event)  # rare: a whole step later the copy is long done
        return bool(host.item() > 0)  # host memory: no sync

    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, *, keep_last: int = 3,
        extra: dict[str, Any] | None = None, background: bool = False, **objects: Any,
    ) -> Any:
        """Save ``step`` with ``objects`` and this state under the name ``session`` (every rank)."""
        from gpukit.checkpoint import CheckpointManager

        self._steps.warn_if_pending(f"save_checkpoint(step={step}) (those gradients are not saved)")
        return CheckpointManager(directory, keep_last=keep_last).save(
            step, extra=extra, background=background, session=self, **objects)

    def wait_for_saves(self) -> None:
        """Wait for a background save still writing; raise its failure (every rank alike)."""
        from gpukit.checkpoint import wait_for_saves

        wait_for_saves()

    def resume(self, directory: str | os.PathLike[str], **objects: Any) -> int | None:
        """Restore ``objects`` and this state from the latest complete checkpoint in ``directory``."""
        from gpukit.checkpoint import CheckpointManager

        manager = CheckpointManager(directory)
        step = manager.resume(session=self, **objects)
        info = None
        if step is not None:
            epoch, batch = loader_position(objects)
            info = ResumeInfo(step, manager.step_directory(step), dict(manager.extra), epoch, batch)
        self.resumed = info
        if self._verbose and self._strategy.rank == 0:
            print(resume_line(info, directory), file=sys.stderr, flush=True)
        return step

    def state_dict(self) -> dict[str, Any]:
        backoff = self._memory.oom_backoff
        return {
            **self._steps.state_dict(),
            "precision": self._strategy.precision.state_dict(),
            "oom_micro_batch_size": backoff.micro_batch_size if backoff else None,
            "schedulers": [s.state_dict() for s in self.schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.load_state_dict(state)
        self._strategy.precision.load_state_dict(state.get("precision", {}))
        self._memory.restore_backoff(state.get("oom_micro_batch_size"))
        saved = state.get("schedulers") or []
        if saved and len(saved) != len(self.schedulers):
            raise CheckpointError(
                f"The checkpoint holds {len(saved)} scheduler(s) set up with session.setup_scheduler, this "
                f"session has {len(self.schedulers)}: set up the same schedulers before resuming."
            )
        for scheduler, scheduler_state in zip(self.schedulers, saved):
            scheduler.load_state_dict(scheduler_state)
