"""Learning-rate schedulers that count optimizer steps: ``session.setup_scheduler(scheduler)``.

A schedule is written in optimizer steps ("warm up for 2,000 steps, then cosine to 600,000"). A
loop that calls ``scheduler.step()`` once per batch advances it too fast under gradient
accumulation (every micro-batch) and when fp16 skips a step. The :class:`SessionScheduler` that
``setup_scheduler`` returns is called the same way, once per batch after ``session.step``, and
steps the scheduler once for every optimizer step actually taken since its last call:

* ``interval="step"`` (default): once per optimizer step -- not per micro-batch, not for a step
  16-mixed skipped on inf/nan gradients, and the same whatever the number of processes (the same
  script gives the same learning rates on 1 or 8 ranks);
* ``interval="epoch"``: call it once per epoch; each call steps once (the scheduler counts epochs).

Accelerate's prepared scheduler chooses differently: it steps ``num_processes`` times per optimizer
step (a schedule written for one process's batches then runs ``num_processes`` times faster under
several), unless ``split_batches=True``. gpukit counts optimizer steps, because that is what the
schedule's numbers mean when the global batch is what stays fixed (``global_batch_size=``).

Its state (the scheduler's and the count of steps it has seen) is saved with ``session.save_checkpoint``
and restored by ``session.resume`` as part of the session's own state; passing it by name as well
does no harm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpukit.errors import ConfigurationError

if TYPE_CHECKING:
    from gpukit.session._steps import TrainingSteps

__all__ = ["INTERVALS", "SessionScheduler"]

INTERVALS = ("step", "epoch")


class SessionScheduler:
    """A scheduler stepped per optimizer step (see the module docstring); other attributes are the scheduler's.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler (anything with ``step`` and ``state_dict``).
        steps: the session's step counts.
        interval: ``"step"`` or ``"epoch"``.

    Raises:
        ConfigurationError: an unknown interval, or something that is no scheduler.
    """

    def __init__(self, scheduler: Any, steps: TrainingSteps, interval: str = "step") -> None:
        if interval not in INTERVALS:
            raise ConfigurationError(f"setup_scheduler(interval={interval!r}); use 'step' or 'epoch'.")
        if isinstance(scheduler, SessionScheduler) or not callable(getattr(scheduler, "step", None)):
            raise ConfigurationError(
                f"setup_scheduler got a {type(scheduler).__name__}; pass the torch.optim.lr_scheduler "
                "scheduler itself (once)."
            )
        self.scheduler = scheduler
        self.interval = interval
        self._steps = steps
        self._seen = steps.optimizer_steps  # optimizer steps already reflected in the schedule

    def step(self, *args: Any, **kwargs: Any) -> int:
        """Step the scheduler once per optimizer step since the last call (``"epoch"``: once).

        Returns:
            How many times it stepped.
        """
        if self.interval == "epoch":
            self.scheduler.step(*args, **kwargs)
            return 1
        due = self._steps.optimizer_steps - self._seen
        self._seen = self._steps.optimizer_steps
        for _ in range(due):
            self.scheduler.step(*args, **kwargs)
        return max(due, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "seen": self._seen, "interval": self.interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._seen = int(state.get("seen", self._steps.optimizer_steps))

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SessionScheduler({type(self.scheduler).__name__}, interval={self.interval!r})"
