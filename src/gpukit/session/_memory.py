"""The memory component of :class:`gpukit.Session`: OOM back-off, leak watching, inference guards.

The Session holds one :class:`SessionMemory` and delegates ``run_step``, ``watch_memory``,
``memory_report``, ``free_memory`` and ``oom_backoff`` to it. Every method here is a thin layer
over :mod:`gpukit.memory`, which owns the logic; what the component adds is the composition with
the session's step: autocast (the precision), accumulation, the GradScaler and DDP's gradient
sync (the session's :class:`~gpukit.session._steps.TrainingSteps`, which it gets when built).

How ``run_step`` keeps the maths of a step when it backs off (``oom="backoff"``):

* each micro-batch's loss is weighted by ``len(micro) / len(batch)`` and goes through
  the session's backward (which divides by ``accumulate_grad_batches`` and scales for fp16), so
  the summed gradient is the batch's mean-loss gradient whatever the split;
* gradients of earlier batches of the accumulation window are set aside while the batch runs
  and added back afterwards, so dropping a failed attempt's partial gradients loses nothing;
* under DDP every micro-batch runs without gradient sync, the ranks agree on OOM through one
  small all-reduce, and the gradients are averaged once, on the accumulation boundary.
"""

from __future__ import annotations

import contextlib
import io
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from gpukit import memory as _memory
from gpukit.errors import ConfigurationError
from gpukit.memory import batch_length
from gpukit.placement import device_mover, unwrap_model

if TYPE_CHECKING:
    from gpukit.accelerators import Accelerator
    from gpukit.session._steps import TrainingSteps
    from gpukit.strategies import Strategy

__all__ = ["SessionMemory", "check_memory_options", "OOM_MODES", "DEFAULT_WATCH_EVERY_N_STEPS"]

OOM_MODES = (None, "raise", "backoff")
DEFAULT_WATCH_EVERY_N_STEPS = 10

_FIXES = (
    "Fixes: Session(oom='backoff') splits batches that do not fit; or lower the batch size, use "
    "precision='bf16-mixed', activation checkpointing or more devices. "
    "gpukit.memory.estimate_memory(...) shows where the memory goes."
)


def check_memory_options(oom: str | None, watch_memory: bool | int, sync_batchnorm: bool) -> int | None:
    """Validate the Session's memory options; returns the leak-check interval or ``None``."""
    if oom not in OOM_MODES:
        raise ConfigurationError(
            f"Session(oom={oom!r}): choose one of {', '.join(map(repr, OOM_MODES))} (None: out of "
            "memory propagates as torch raised it; 'raise': write a post-mortem, then raise; "
            "'backoff': halve the micro-batch and retry)."
        )
    if oom == "backoff" and sync_batchnorm:
        raise ConfigurationError(
            "Session(oom='backoff', sync_batchnorm=True): SyncBatchNorm communicates inside every "
            "forward, so a rank that runs out of memory mid-forward would leave the others waiting. "
            "Use one of the two (micro-batches also change BatchNorm statistics)."
        )
    if isinstance(watch_memory, bool):
        return DEFAULT_WATCH_EVERY_N_STEPS if watch_memory else None
    if not isinstance(watch_memory, int) or watch_memory < 1:
        raise ConfigurationError(
            f"Session(watch_memory={watch_memory!r}): use True (check every "
            f"{DEFAULT_WATCH_EVERY_N_STEPS} steps), False, or an int >= 1 (steps between checks)."
        )
    return watch_memory


def _drop_grads(params: list[nn.Parameter]) -> None:
    for param in params:
        param.grad = None


class SessionMemory:
    """Memory methods of :class:`gpukit.Session` (see the module docstring).

    Args:
        oom: the Session's ``oom`` option (already checked by :func:`check_memory_options`).
        watch_every: steps between leak checks from the first step, or ``None``.
        strategy, accelerator: the Session's (the strategy's precision autocasts ``step_fn``).
        steps: the Session's training step (accumulation window, backward), composed around ``step_fn``.
    """

    def __init__(
        self, oom: str | None, watch_every: int | None, *, strategy: Strategy, accelerator: Accelerator,
        steps: TrainingSteps,
    ) -> None:
        if oom == "backoff" and strategy.layout.tensor > 1:
            raise ConfigurationError(
                "oom='backoff' splits a batch and averages the gradients by hand, which it cannot do yet for "
                "layers split by tensor_parallel; use oom='raise' (or None) with tensor_parallel."
            )
        if oom == "backoff" and not strategy.plain_parameters:
            raise ConfigurationError(
                "Session(strategy='fsdp', oom='backoff'): FSDP gathers every unit's parameters from all ranks "
                "inside the forward, so a rank that runs out of memory mid-forward leaves the others waiting in "
                "that collective (a hang), and the gradients of the failed attempt stay inside FSDP. Use "
                "oom='raise' (or None) with FSDP, and plan a micro-batch that fits with Session(fit=...) or "
                "`gpukit plan --fit`."
            )
        self._oom = oom
        self._watch_every = watch_every
        self._strategy = strategy
        self._accelerator = accelerator
        self._steps = steps
        self._backoff: _memory.OomBackoff | None = None
        self._micro_batch: int | None = None  # Session(fit=...): run_step splits batches into these
        self._mover: tuple[torch.device, Callable[[Any], Any]] | None = None  # run_step's batch -> device
        self._leak_watcher: _memory.LeakWatcher | None = None
        self._models: list[nn.Module] = []
        self._guards: dict[int, _memory.InferenceGuard] = {}
        self._step_params: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()

    @property
    def _device(self) -> torch.device:
        return self._strategy.root_device

    # -- public ---------------------------------------------------------------------------------
    def run_step(
        self, step_fn: Callable[[Any], torch.Tensor], batch: Any, *, model: nn.Module | None = None
    ) -> torch.Tensor:
        """Forward and backward of one batch: ``loss = step_fn(batch)`` under autocast, then backward.

        Replaces the ``with session.accumulate(model): with session.autocast(): ...;
        session.backward(loss)`` block; call ``session.step(optimizer)`` after it as usual.
        With ``Session(oom="backoff")`` a batch that runs out of memory is split into halves,
        quarters, ... (the smaller micro-batch is kept for later steps); the gradient stays that
        of the whole batch, and under DDP all ranks agree on the new size.

        Args:
            step_fn: ``step_fn(batch) -> loss``: the forward pass and a scalar *mean* loss over
                the items of ``batch`` (it may be called on slices of ``batch``).
            batch: a tensor or a (nested) tuple/list/dict of tensors, batch dimension first; moved
                to the session's device if it is not there (split into micro-batches on the host first).
            model: the model ``step_fn`` runs; needed only when ``setup`` was given several.

        Returns:
            The batch's loss, detached (``total += session.run_step(...)`` keeps no graph).

        Raises:
            StepOutOfMemoryError: out of memory with ``oom="raise"``, or
                :class:`~gpukit.memory.OutOfMemoryAfterBackoffError` when even a micro-batch of
                one item does not fit; the message carries the post-mortem.
            ConfigurationError: ``step_fn`` did not return a scalar tensor; no or several models.
        """
        model = self._step_model(model)
        if self._oom == "backoff" or self._micro_batch is not None:
            return self._run_with_backoff(step_fn, batch, model)
        with self._postmortem_on_oom(batch) if self._oom == "raise" else contextlib.nullcontext():
            with self._steps.accumulate(model):
                loss = self._forward(step_fn, batch)
                self._steps.backward(loss)
        return loss.detach()

    @property
    def oom_backoff(self) -> _memory.OomBackoff | None:
        """The back-off state with ``oom="backoff"`` (``micro_batch_size`` -- ``None`` until the
        first out-of-memory --, ``accumulation_steps``, ``events``); ``None`` otherwise."""
        return self._backoff

    def watch_memory(self, every_n_steps: int = DEFAULT_WATCH_EVERY_N_STEPS, **options: Any) -> _memory.LeakWatcher:
        """Check for memory leaks every ``every_n_steps`` calls of ``session.step``.

        Names the variable behind a leak (``total_loss += loss``, a list of outputs with graphs,
        steady growth) in a :class:`~gpukit.memory.MemoryLeakWarning`. Replaces any earlier watcher.

        Args:
            every_n_steps: steps between checks (10 names ``total_loss += loss`` by step 20).
            **options: more :class:`~gpukit.memory.LeakWatcher` options (``warn``, ``on_leak``...).

        Returns:
            The watcher; its ``findings`` list what was found.
        """
        self._leak_watcher = _memory.LeakWatcher(every_n_steps, device=self._device, **options)
        return self._leak_watcher

    def memory_report(self) -> _memory.MemoryReport:
        """Memory of this session's device (see :func:`gpukit.memory_report`)."""
        return _memory.memory_report(self._device)

    def free_memory(self) -> int | None:
        """Collect garbage and return cached blocks of ``session.device`` to the driver.

        For between phases -- after training, before evaluation or export -- once the previous
        phase's tensors are ``del``-ed; not every step (the allocator would only ask again).

        Returns:
            Bytes of reserved memory given back; ``None`` on the CPU (no allocator cache).
        """
        return _memory.free_memory(self._device)

    # -- called by the Session ---------------------------------------------------------------
    def after_step(self) -> None:
        watcher = self._leak_watcher
        if watcher is None:
            if self._watch_every is None:
                return
            watcher = self.watch_memory(self._watch_every)  # Session(watch_memory=...): from step 1
        watcher.step()

    def track_model(self, model: nn.Module) -> None:
        self._models = [m for m in self._models if unwrap_model(m) is not unwrap_model(model)]
        self._models.append(model)
        inner = unwrap_model(model)
        if id(inner) not in self._guards:
            self._guards[id(inner)] = _memory.inference_guard(inner)

    def close(self) -> None:
        for guard in self._guards.values():
            guard.remove()
        self._guards.clear()
        self._models.clear()
        self._step_params.clear()
        self._leak_watcher = None
        self._watch_every = None

    # -- the step ------------------------------------------------------------------------------
    def _step_model(self, model: nn.Module | None) -> nn.Module:
        if model is not None:
            return model
        if len(self._models) == 1:
            return self._models[0]
        raise ConfigurationError(
            f"session.run_step needs to know the model: {len(self._models)} models were set up. "
            + ("Call session.setup(model, optimizer) first." if not self._models
               else "Pass the one step_fn runs: session.run_step(step_fn, batch, model=model).")
        )

    def _forward(self, step_fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        # a batch (or micro-batch: split on the host first) not yet on the device is moved, as
        # setup_dataloader's batches are: a CPU batch on a GPU session must not end in torch's
        # "Expected all tensors to be on the same device" (seen on an H100 in the fit test)
        device = self._device
        if self._mover is None or self._mover[0] != device:
            self._mover = (device, device_mover(device))
        batch = self._mover[1](batch)
        with self._strategy.precision.autocast():
            loss = step_fn(batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigurationError(
                f"session.run_step: step_fn returned {got}; it must return the loss as a scalar "
                "tensor (the mean over the batch), e.g. `return F.cross_entropy(model(x), y)`."
            )
        return loss

    def use_micro_batch(self, size: int) -> None:
        """Split every ``run_step`` batch into micro-batches of ``size`` (``Session(fit=...)``).

        Without ``oom="backoff"`` the size is kept: out of memory at it raises (with the planned
        fixes) instead of halving further."""
        self._micro_batch = size
        minimum = 1 if self._oom == "backoff" else size
        self._backoff = _memory.OomBackoff(size, min_micro_batch_size=minimum, device=self._device)

    def restore_backoff(self, micro_batch_size: int | None) -> None:
        """Start from the micro-batch size a checkpointed run had backed off to."""
        if micro_batch_size is not None and self._oom == "backoff":
            self._backoff = _memory.OomBackoff(int(micro_batch_size), device=self._device)

    def _run_with_backoff(self, step_fn: Callable[[Any], torch.Tensor], batch: Any, model: nn.Module) -> torch.Tensor:
        if self._backoff is None:
            self._backoff = _memory.OomBackoff(None, device=self._device)
        params = self._step_params.get(model)
        if params is None:  # once per model: listing parameters costs ~1 us each, every step
            params = self._step_params[model] = list(model.parameters())
        backoff = self._backoff
        boundary = self._steps.next_is_boundary()
        # FSDP (parameters not plain): its reduce-scatter in backward is what puts the averaged gradient shard
        # in .grad -- under its no-sync every gradient stays unsharded inside FSDP and .grad stays None -- so
        # the boundary's micro-batches run with it, and nothing is averaged by hand afterwards
        sharded = not self._strategy.plain_parameters
        backoff.no_sync = (contextlib.nullcontext if sharded and boundary
                           else lambda: self._strategy.no_backward_sync(model))
        backoff.sync_module = model  # DDP's forward buffer-sync flag is reset for each attempt
        backoff.zero_grad = lambda: _drop_grads(params)
        if len(self._models) == 1:  # its planned fixes name the options for the micro-batch that failed
            backoff.model, backoff.precision = unwrap_model(self._models[0]), self._strategy.precision.name
            backoff.activation_checkpointing = self._strategy.activation_checkpointing
        held = [p.grad for p in params]  # earlier batches of this accumulation window
        _drop_grads(params)

        def micro_step(part: Any, weight: float) -> torch.Tensor:
            loss = self._forward(step_fn, part)
            if weight != 1:
                loss = loss * weight
            self._steps.backward(loss)
            return loss.detach()

        try:
            losses = backoff.run(micro_step, batch)
        except BaseException as exc:
            for param, grad in zip(params, held):  # a failed batch leaves no partial gradient
                param.grad = grad
            if isinstance(exc, _memory.OutOfMemoryAfterBackoffError):
                # the back-off's message names the planned fixes for the micro-batch that failed
                self._raise_out_of_memory(exc, _memory.OutOfMemoryAfterBackoffError, str(exc), fixes="")
            raise
        for param, grad in zip(params, held):
            if grad is not None:
                param.grad = grad if param.grad is None else grad.add_(param.grad)
        if boundary and self._strategy.data_parallel_size > 1 and not sharded:
            _memory.average_gradients(params)
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        return total

    @contextlib.contextmanager
    def _postmortem_on_oom(self, batch: Any) -> Iterator[None]:
        try:
            yield
        except self._accelerator.oom_error_types() as exc:
            # inside the except block the failed step's tensors are still alive: the snapshot sees them
            self._raise_out_of_memory(
                exc, _memory.StepOutOfMemoryError,
                f"Out of memory in session.run_step on {self._device} with a batch of "
                f"{batch_length(batch)} items (Session(oom='raise')).",
                fixes=self._planned_fixes(batch) or _FIXES,
            )

    def _planned_fixes(self, batch: Any) -> str | None:
        """The fixes with the planner's predicted saving for this model and batch (None: not plannable)."""
        from gpukit.memory import planned_fixes

        if len(self._models) != 1:
            return None
        return planned_fixes(unwrap_model(self._models[0]), batch, precision=self._strategy.precision.name,
                             activation_checkpointing=self._strategy.activation_checkpointing, device=self._device)

    def _raise_out_of_memory(
        self, exc: BaseException, error: type[Exception], headline: str, fixes: str = _FIXES
    ) -> NoReturn:
        text = io.StringIO()
        _memory.write_oom_snapshot(device=self._device, file=text)
        # the failed frames hold the step's activations; the new error keeps exc as its cause
        traceback.clear_frames(exc.__traceback__)
        raise error("\n".join(part for part in (headline, text.getvalue().rstrip(), fixes) if part)) from exc
