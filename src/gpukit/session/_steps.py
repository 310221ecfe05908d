"""The Session's training step: backward, gradient accumulation, the optimizer step, and the counts.

:class:`TrainingSteps` counts micro-batches and optimizer steps and knows when a micro-batch ends
an accumulation window. The Session's ``accumulate``, ``backward`` and ``step`` delegate to it;
its memory component (``run_step``, OOM back-off) runs micro-batches through the same object, and
its run state saves and restores the counts -- one object they share instead of each reading the
other's private attributes.

**Windows end with the loader.** With ``accumulate_grad_batches=k`` a window is ``k`` micro-batches,
except where a gpukit loader's pass has fewer left: 10 batches with ``k=4`` make windows of 4, 4
and 2 (three optimizer steps, as Accelerate and Lightning), and the last window's losses are
divided by 2, its real size, so each step's gradient is the mean over the micro-batches it
covers. The size is fixed at a window's first micro-batch, from the loader handing out batches
(:class:`~gpukit.session._loaders.LoaderTracker`). ``Session(step_at_loader_end=False)`` keeps the
old behaviour: windows of ``k`` that run on into the next epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import ConfigurationError
from gpukit.session._plain_passes import PlainLoaderPasses

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gpukit.session._loaders import LoaderTracker
    from gpukit.strategies import Strategy

T = TypeVar("T")

__all__ = ["PendingGradientsWarning", "TrainingSteps", "check_accumulation"]


class PendingGradientsWarning(UserWarning):
    """Micro-batches' gradients were left waiting for an optimizer step that did not come."""


def check_accumulation(value: Any) -> int:
    """``value`` as a number of micro-batches per step.

    Raises:
        ConfigurationError: not an int >= 1.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"accumulate_grad_batches={value!r}; use an int >= 1.")
    return value


class TrainingSteps:
    """Backward and optimizer steps for ``accumulate_grad_batches`` micro-batches a step.

    Args:
        strategy: skips the gradient sync inside a window (``no_backward_sync``), clips gradients;
            its precision scales the loss (fp16), unscales and steps the optimizer.
        accumulate_grad_batches: micro-batches per optimizer step (checked by the Session).
        loaders: the gpukit loader handing out batches (how many are left in its pass).
        step_at_loader_end: end a window with the loader's pass (see the module docstring).
    """

    def __init__(self, strategy: Strategy, accumulate_grad_batches: int,
                 loaders: LoaderTracker | None = None, step_at_loader_end: bool = True) -> None:
        self._strategy = strategy
        self._k = check_accumulation(accumulate_grad_batches)
        self._loaders = loaders
        self.step_at_loader_end = bool(step_at_loader_end)
        self.micro_step = 0
        self._micro_at_pass_end = 0  # micro_step when a gpukit loader's pass last ended
        self.optimizer_steps = 0
        self.in_window = 0  # micro-batches of the open window already counted by step()
        self._window: int | None = None  # its size, fixed at its first micro-batch
        #: total gradient norm (before clipping) of the last optimizer step that clipped: a tensor
        self.grad_norm: torch.Tensor | None = None
        self._warned_at: int | None = None  # micro_step of the last pending warning: one per window
        self._plain = PlainLoaderPasses(self.warn_if_pending)  # a plain DataLoader's new pass, mid-window

    @property
    def accumulate_grad_batches(self) -> int:
        return self._k

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        value = check_accumulation(value)
        if self.in_window and value != self._k:
            raise ConfigurationError(
                f"accumulate_grad_batches cannot change from {self._k} to {value} with {self.in_window} "
                "micro-batch(es) of a window pending; change it right after a session.step that returned True."
            )
        self._k = value
        self._window = None  # a size decided for the next window (by a query before its first step) is stale

    def window_size(self) -> int:
        """Micro-batches in the open window: ``k``, or fewer where the loader's pass ends sooner."""
        if self._window is None:
            size = self._k
            if size > 1 and self.step_at_loader_end and self._loaders is not None:
                left = self._loaders.batches_left()
                if left is not None:
                    # the ones of it already done count too: a window sized part-way (a resume inside it)
                    # ends where it would have, with the pass, not ``left`` micro-batches on
                    size = max(1, min(size, self.in_window + left))
            self._window = size
        return self._window

    def next_is_boundary(self) -> bool:
        """Whether the micro-batch about to run is the last of its accumulation window."""
        size = self._window  # decided at the window's first micro-batch: no call once it is
        return self.in_window + 1 >= (size if size is not None else self.window_size())

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """No gradient sync (DDP, FSDP) except on the last micro-batch of a window."""
        if self.next_is_boundary():
            return contextlib.nullcontext()
        return self._strategy.no_backward_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the window's size and scaled for fp16."""
        size = self._window if self._window is not None else self.window_size()
        if size > 1:
            # summed over the micro-batches this gives the gradient of the mean loss
            loss = loss / size
        self._strategy.precision.scale_loss(loss).backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None) -> bool:
        """Count a micro-batch; at the end of a window clip, step and zero the grads (True: it stepped)."""
        if self._k > 1:
            self._plain.before_micro_batch(self.in_window)
        self.micro_step += 1
        size = self._window if self._window is not None else self.window_size()
        self.in_window += 1
        if self.in_window < size:
            return False
        self.in_window, self._window = 0, None
        if clip_grad_norm is not None:
            self._strategy.precision.unscale_(optimizer)  # the norm of the true gradients (fp16: found inf/nan too)
            self.grad_norm = self._strategy.clip_gradients(optimizer, clip_grad_norm)
        stepped = self._strategy.precision.optimizer_step(optimizer)  # 16-mixed: skipped when inf/nan were found
        optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += int(stepped)
        return stepped

    def warn_if_pending(self, where: str) -> None:
        """Warn that ``where`` leaves gradients of micro-batches waiting for a step (once per window)."""
        if self.in_window and self._warned_at != self.micro_step:
            self._warned_at = self.micro_step
            warn_at_user_code(PendingGradientsWarning(
                f"{where}: {self.in_window} micro-batch(es) of an accumulation window of "
                f"{self.window_size()} have gradients that no optimizer step used yet. A gpukit loader "
                "(session.setup_dataloader) ends each window with its pass; over other iterables, make "
                "the number of batches a multiple of accumulate_grad_batches, or step yourself."
            ))

    def warn_pending_at_end(self, batches: Iterator[T], source: Iterable[Any]) -> Iterator[T]:
        """``batches`` (``session.progress`` over ``source``); at their end, warn when ``source`` is not a
        gpukit loader (which ends its windows itself) and gradients are left waiting for a step."""
        yield from batches
        from gpukit.data import DeviceLoader

        if not isinstance(source, DeviceLoader):
            self.warn_if_pending("the loop over a non-gpukit iterable ended")

    def pass_ended(self, has_length: bool) -> None:
        """A gpukit loader finished its pass: without a length its last window could not be cut short."""
        if self.step_at_loader_end and not has_length:
            self.warn_if_pending("the loader's pass ended (it has no len(), so its last window was not cut short)")
        self._micro_at_pass_end = self.micro_step

    def trained_this_pass(self) -> bool:
        """Whether the pass that just ended looks like training: gradients on as it ends, and ``session.step``
        ran during it -- or never ran at all (a loop that steps its optimizer itself). An evaluation pass
        (under ``torch.no_grad()``, or without a step in a loop that steps with ``session.step``) does not."""
        return torch.is_grad_enabled() and (self.micro_step == 0 or self.micro_step > self._micro_at_pass_end)

    def state_dict(self) -> dict[str, int]:
        """The counts a checkpoint carries."""
        return {"micro_step": self.micro_step, "optimizer_steps": self.optimizer_steps,
                "in_window": self.in_window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.micro_step = int(state.get("micro_step", 0))
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        # checkpoints from before windows ended with the loader: windows of k from the start
        self.in_window = int(state.get("in_window", self.micro_step % self._k))
        self._window = None

