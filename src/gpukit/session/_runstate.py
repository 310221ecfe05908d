"""The run-state component of :class:`gpukit.Session`: stopping together, and the session's own
state that checkpoints carry.

The Session holds one :class:`RunState` and delegates ``should_stop``, ``save_checkpoint``,
``resume``, ``state_dict`` and ``load_state_dict`` to it. ``should_stop`` turns a stop request (SIGTERM/SIGINT caught by
:mod:`gpukit.worker`) into one answer on every rank; the state is the step counter,
the precision's (GradScaler) state, the micro-batch size OOM back-off settled on, the schedulers
of ``setup_scheduler`` and the data-parallel size and accumulation it trained with: resumed on
another number of data-parallel ranks, the accumulation changes to keep the global batch
(``_batching.rescale_accumulation``). ``resume`` keeps what it did in ``resumed`` and says it on rank 0.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import CheckpointError
from gpukit.session._batching import rescale_accumulation
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
        micro_batch_size: ``Session(micro_batch_size=...)`` (for the line a rescaled accumulation prints).
        global_batch_given: ``Session(global_batch_size=...)`` was given: the accumulation is the
            session's own choice for this world size, not rescaled from a checkpoint's.
    """

    def __init__(self, *, strategy: Strategy, steps: TrainingSteps, memory: SessionMemory,
                 verbose: bool = False, micro_batch_size: int | None = None,
                 global_batch_given: bool = False) -> None:
        self._strategy = strategy
        self._micro_batch_size = micro_batch_size
        self._global_batch_given = global_batch_given
        self._steps = steps
        self._memory = memory
        self._verbose = verbose
        #: schedulers of ``session.setup_scheduler``, saved and restored with the session's state
        self.schedulers: list[SessionScheduler] = []
        #: what the last ``resume`` did (``session.resumed``)
        self.resumed: ResumeInfo | None = None
        self._stop_read: tuple[torch.Tensor, Any] | None = None  # the last call's agreement, on its way to the host
        # the objects of the save / resume under way: their gpukit loader's batch size is the micro-batch
        self._saving: dict[str, Any] = {}
        self._resuming: dict[str, Any] = {}

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop; every rank gets the same answer (one all-reduce).

        On a device that is not the host the answer comes one call late, without a sync: each call
        starts reducing its flag and copying the result back asynchronously, and returns the previous
        call's result (every rank makes the same calls, so every rank gets the same answer at the same
        call); it waits only if the device has not finished that copy since the previous call."""
        from gpukit.worker import mark_stop_agreed, stop_kind

        # what each rank was asked (none, stop, preempted): every rank learns the highest, so a rank
        # whose own warning has not come (or never comes) still knows the job is being preempted
        kind = stop_kind()
        strategy = self._strategy
        if strategy.world_size > 1 and strategy.launched:
            if strategy.accelerator.is_host:
                flag = torch.tensor(float(kind), device=strategy.root_device)
                kind = int(strategy.all_reduce(flag, op="max").item())
            else:
                kind = self._agreed_a_call_late(kind)
        if kind:
            mark_stop_agreed(strategy.rank, kind)  # gpukit run exits 75 even if only one rank got it
        return kind > 0

    def _agreed_a_call_late(self, kind: int) -> int:
        strategy = self._strategy
        accelerator = strategy.accelerator
        flag = torch.full((), float(kind), device=strategy.root_device)  # a fill: no copy from the host
        reduced = strategy.all_reduce(flag, op="max")
        previous, self._stop_read = self._stop_read, accelerator.to_host_async(reduced)
        if previous is None:
            return 0
        host, event = previous
        if event is not None and not accelerator.event_done(event):
            accelerator.wait_event(event)  # rare: a whole step later the copy is long done
        return int(host.item())  # host memory: no sync

    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, *, keep_last: int = 3,
        extra: dict[str, Any] | None = None, background: bool = False, **objects: Any,
    ) -> Any:
        """Save ``step`` with ``objects`` and this state under the name ``session`` (every rank)."""
        from gpukit.checkpoint import CheckpointManager

        self._steps.warn_if_pending(f"save_checkpoint(step={step}) (those gradients are not saved)")
        self._saving = objects
        try:
            return CheckpointManager(directory, keep_last=keep_last).save(
                step, extra=extra, background=background, session=self, **objects)
        finally:
            self._saving = {}

    def wait_for_saves(self) -> None:
        """Wait for a background save still writing; raise its failure (every rank alike)."""
        from gpukit.checkpoint import wait_for_saves

        wait_for_saves()

    def resume(self, directory: str | os.PathLike[str], **objects: Any) -> int | None:
        """Restore ``objects`` and this state from the latest complete checkpoint in ``directory``."""
        from gpukit.checkpoint import CheckpointManager

        manager = CheckpointManager(directory)
        self._resuming = objects
        try:
            step = manager.resume(session=self, **objects)
        finally:
            self._resuming = {}
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
        micro = self._micro_for(self._saving)
        return {
            **self._steps.state_dict(),
            "precision": self._strategy.precision.state_dict(),
            "oom_micro_batch_size": backoff.micro_batch_size if backoff else None,
            "schedulers": [s.state_dict() for s in self.schedulers],
            "data_parallel_size": self._strategy.data_parallel_size,
            "accumulate_grad_batches": self._steps.accumulate_grad_batches,
            "samples_per_step": None if micro is None else
            micro * self._strategy.data_parallel_size * self._steps.accumulate_grad_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._keep_global_batch(state)
        self._steps.load_state_dict(state)
        in_window = self._open_window(state)
        if in_window is not None:  # the saved count is in micro-batches of another layout
            self._steps.in_window = in_window
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

    def _keep_global_batch(self, state: dict[str, Any]) -> None:
        """The accumulation that keeps the saved global batch in samples (said on rank 0; a warning where it
        cannot be kept exactly). Only where the micro-batch is known on both sides -- a gpukit loader among
        the objects saved and resumed, or ``Session(micro_batch_size=...)``: a script that feeds batches of
        its own may scale them with the world size itself."""
        saved_samples, saved_ranks = state.get("samples_per_step"), state.get("data_parallel_size")
        micro = self._micro_for(self._resuming)
        if self._global_batch_given or micro is None or not isinstance(saved_samples, int):
            return  # Session(global_batch_size=...) chose it for this size; not known; an older checkpoint
        if saved_samples < 1:
            raise CheckpointError(f"The session state holds samples_per_step={saved_samples}; it must be >= 1 "
                                  "(a damaged or hand-edited checkpoint).")
        steps = self._steps
        change = rescale_accumulation(saved_samples, steps.accumulate_grad_batches, micro,
                                      self._strategy.data_parallel_size, int(saved_ranks or 0))
        if change is None:
            return
        steps.in_window = 0  # the setter refuses a change inside a window; load_state_dict sets the count after
        steps.accumulate_grad_batches = change.accumulate_grad_batches
        if not change.exact:
            warn_at_user_code(UserWarning(change.line.removeprefix("gpukit: ")))
        elif self._verbose and self._strategy.rank == 0:
            print(change.line, file=sys.stderr, flush=True)

    def _open_window(self, state: dict[str, Any]) -> int | None:
        """The saved open accumulation window's micro-batches done, counted in this session's micro-batches
        where they differ from the saved ones (another micro-batch or number of data-parallel ranks): the
        same samples of the window, so the next step ends where the saved run's would have; 0 -- the window
        restarts -- where they make no whole number of them. ``None``: the saved count stands (the same
        layout, or one this session or the checkpoint does not know)."""
        saved_samples, saved_k, done = (state.get(key) for key in ("samples_per_step", "accumulate_grad_batches",
                                                                   "in_window"))
        micro = self._micro_for(self._resuming)
        if micro is None or not all(isinstance(v, int) and v > 0 for v in (saved_samples, saved_k)):
            return None  # not known here, or an older checkpoint
        saved_micro = saved_samples // saved_k  # micro-batch x data-parallel ranks when it was saved
        per_micro = micro * self._strategy.data_parallel_size
        if saved_micro == per_micro or saved_samples % saved_k:
            return None
        if not isinstance(done, int) or done < 0:
            return 0
        whole, rest = divmod(done * saved_micro, per_micro)
        return whole if rest == 0 and whole < self._steps.accumulate_grad_batches else 0

    def _micro_for(self, objects: dict[str, Any]) -> int | None:
        """Samples per micro-batch: the batch size of a gpukit loader (one gpukit shards) among ``objects``,
        else ``Session(micro_batch_size=...)``, else ``None`` (not known)."""
        for obj in objects.values():
            if getattr(obj, "samples_consumed", None) is not None and isinstance(getattr(obj, "batch_size", None), int):
                return int(obj.batch_size)
        return self._micro_batch_size
