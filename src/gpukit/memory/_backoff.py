"""Recover from out-of-memory: halve the micro-batch, double accumulation, same maths.

``OomBackoff.run(step_fn, batch)`` splits ``batch`` into micro-batches and calls
``step_fn(micro_batch, weight)`` on each, where ``weight = len(micro_batch) / len(batch)``; the
step function scales its loss by ``weight`` before ``backward()`` so the accumulated gradient is
the full batch's mean-loss gradient whatever the split. When a micro-batch raises the
accelerator's out-of-memory type (by type, never by message), the backoff

1. frees what the failed attempt held: the traceback's frames keep every local of the failed
   forward alive, so they are cleared and the exception object is dropped *outside* the
   ``except`` block before anything is retried;
2. empties the allocator cache and zeroes the partially accumulated gradients;
3. halves the micro-batch (accumulation doubles) and runs the whole batch again.

Under ``torch.distributed`` every rank runs the micro-batches without gradient sync, then all
ranks all-reduce a "had OOM" flag -- a rank that failed joins this collective like the others,
so nobody hangs -- and either all retry with the same smaller micro-batch (an all-reduce MIN of
the proposals) or all average their gradients. The caller then calls ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpukit.accelerators import Accelerator, auto_device_type, get_accelerator
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.monitor import emit

__all__ = ["OomBackoff", "BackoffEvent", "StepOutOfMemoryError", "OutOfMemoryAfterBackoffError", "average_gradients", "split_batch", "batch_length"]

log = logging.getLogger("gpukit.memory")


class StepOutOfMemoryError(MemoryPlanError, torch.OutOfMemoryError):
    """A training step ran out of memory and nothing recovered it (``session.run_step`` adds the
    post-mortem to the message); ``except torch.OutOfMemoryError`` catches it."""


class OutOfMemoryAfterBackoffError(StepOutOfMemoryError):
    """Out of memory even at the smallest micro-batch; ``except torch.OutOfMemoryError`` catches it."""


@dataclass(frozen=True)
class BackoffEvent:
    """One back-off: the micro-batch went from ``old`` to ``new`` items at call ``call_index``."""

    call_index: int
    old_micro_batch_size: int
    new_micro_batch_size: int
    accumulation_steps: int
    ranks_out_of_memory: int


def batch_length(batch: Any) -> int:
    """Items in a batch: dim 0 of its first tensor (tensor, tuple, list or dict, nested).

    Raises:
        ConfigurationError: when the batch holds no tensor.
    """
    # fast path for the common shapes: a step of a small model must not pay for a tree walk
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    for leaf in torch.utils._pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigurationError(
        f"Cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor "
        "with a batch dimension. Pass a tensor or a tuple/list/dict of tensors (batch dimension first)."
    )


def split_batch(batch: Any, micro_batch_size: int) -> Iterator[Any]:
    """Micro-batches of ``batch`` along dim 0 (views, no copies); non-tensor leaves are shared."""
    total = batch_length(batch)
    if micro_batch_size >= total:  # no split: the batch itself, as given
        yield batch
        return
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    for start in range(0, total, micro_batch_size):
        parts = [
            leaf[start : start + micro_batch_size] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == total else leaf
            for leaf in leaves
        ]
        yield torch.utils._pytree.tree_unflatten(parts, spec)


def average_gradients(parameters: Iterable[torch.nn.Parameter], group: Any = None, bucket_bytes: int = 32 * 2**20) -> None:
    """All-reduce and average ``.grad`` over the ranks of ``group``.

    Gradients travel in flat buffers of at most ``bucket_bytes`` (one dtype and device each), so
    the extra memory is one bucket, not a second copy of every gradient.
    """
    world = dist.get_world_size(group)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_dtype.setdefault((param.grad.dtype, param.grad.device), []).append(param.grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for index, grad in enumerate(grads):
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes or index == len(grads) - 1:
                _average_bucket(bucket, world, group)
                bucket, size = [], 0


def _average_bucket(grads: list[torch.Tensor], world: int, group: Any) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class OomBackoff:
    """Run a training step in micro-batches and shrink them when memory runs out.

    Args:
        micro_batch_size: items per micro-batch to start with; ``None`` starts with whole batches.
        min_micro_batch_size: below this, give up with :class:`OutOfMemoryAfterBackoffError`.
        device: device the step runs on (picks the out-of-memory type and cache to empty).
        zero_grad: called after an OOM to drop partially accumulated gradients, e.g.
            ``optimizer.zero_grad`` -- required for exact maths when backward can run out of memory.
        parameters: parameters whose gradients are averaged across ranks after a successful
            step under ``torch.distributed``; ``None`` leaves gradient sync to the caller.
        no_sync: a context-manager factory suppressing gradient sync during micro-batches
            (``ddp_model.no_sync``), so no rank sits in a backward all-reduce while another fails.
        group: process group for the agreement (default group when distributed).
        on_backoff: called with each :class:`BackoffEvent`.
        model, precision, activation_checkpointing: the plain model the step runs, at this
            precision and checkpointing policy: the first back-off and the final error then name
            the fixes the planner predicts for the micro-batch that ran out of memory (each with
            its saving) instead of a generic list. The Session sets them.

    Raises:
        ConfigurationError: for sizes below 1.
    """

    def __init__(
        self,
        micro_batch_size: int | None = None,
        *,
        min_micro_batch_size: int = 1,
        device: str | torch.device | None = None,
        zero_grad: Callable[[], Any] | None = None,
        parameters: Iterable[torch.nn.Parameter] | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        group: Any = None,
        on_backoff: Callable[[BackoffEvent], None] | None = None,
        model: torch.nn.Module | None = None,
        precision: str = "32-true",
        activation_checkpointing: Any = None,
    ) -> None:
        for name, value in (("micro_batch_size", micro_batch_size), ("min_micro_batch_size", min_micro_batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"OomBackoff({name}={value!r}): expected an int >= 1.")
        self.micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.accelerator: Accelerator = get_accelerator(device if device is not None else auto_device_type())
        self.zero_grad = zero_grad
        self.parameters = list(parameters) if parameters is not None else None
        self.no_sync = no_sync
        self.group = group
        self.on_backoff = on_backoff
        self.events: list[BackoffEvent] = []
        self.accumulation_steps = 1
        self._calls = 0
        #: the DDP model behind ``no_sync`` when that is not its bound method (set by the Session)
        self.sync_module: Any = None
        self.model, self.precision, self.activation_checkpointing = model, precision, activation_checkpointing
        self._advised = False  # the planned fixes are logged with the first back-off only

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def run(self, step_fn: Callable[[Any, float], Any], batch: Any) -> list[Any]:
        """Run ``step_fn(micro_batch, weight)`` over ``batch``, backing off on out-of-memory.

        Returns:
            ``step_fn``'s results, one per micro-batch of the successful attempt.

        Raises:
            OutOfMemoryAfterBackoffError: when even ``min_micro_batch_size`` runs out of memory
                (on every rank together under ``torch.distributed``).
        """
        self._calls += 1
        total = batch_length(batch)
        oom_types = self.accelerator.oom_error_types()
        # DDP broadcasts its buffers (BatchNorm statistics) at the start of a forward that follows a
        # synced one, and clears that flag at the end of each forward under no_sync. A rank whose
        # forward ran out of memory never reached the end, so it alone would broadcast on the retry
        # while the others skip it: mismatched collectives, a hang. Each attempt starts from the
        # flag as it was when the step began, which is the same on every rank.
        ddp = self._ddp_module()
        forward_sync = getattr(ddp, "require_forward_param_sync", None)
        while True:
            if forward_sync is not None:
                ddp.require_forward_param_sync = forward_sync
            micro = min(self.micro_batch_size or total, total)
            self.accumulation_steps = math.ceil(total / micro)
            results: list[Any] = []
            failed = False
            with self.no_sync() if self.no_sync is not None else contextlib.nullcontext():
                for part in split_batch(batch, micro):
                    try:
                        results.append(step_fn(part, batch_length(part) / total))
                    except oom_types as exc:
                        # frames of the failed forward hold its activations; the exception
                        # name is unbound when this block ends, so nothing survives it
                        traceback.clear_frames(exc.__traceback__)
                        failed = True
                        break
            ranks_failed = self._agree(failed)
            if not ranks_failed:
                if self.distributed and self.parameters is not None:
                    average_gradients(self.parameters, self.group)
                return results
            del results
            self._release()
            self._shrink(micro, total, ranks_failed, batch)

    def _ddp_module(self) -> Any:
        owner = self.sync_module if self.sync_module is not None else getattr(self.no_sync, "__self__", None)
        return owner if self.distributed and hasattr(owner, "require_forward_param_sync") else None

    def _agree(self, failed: bool) -> int:
        """How many ranks ran out of memory; every rank calls this once per attempt."""
        if not self.distributed:
            return int(failed)
        flag = torch.tensor([int(failed)], device=self._collective_device())
        dist.all_reduce(flag, group=self.group)
        return int(flag.item())

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return self.accelerator.device(None) if backend == "nccl" else torch.device("cpu")

    def _release(self) -> None:
        if self.zero_grad is not None:
            self.zero_grad()
        gc.collect()
        self.accelerator.empty_cache()

    def planned_fixes(self, batch: Any, micro: int) -> str | None:
        """The planner's fixes for a micro-batch of ``micro`` items of ``batch`` (``None``: no
        ``model`` given, or it cannot be planned)."""
        if self.model is None:
            return None
        from gpukit.memory._advice import planned_fixes

        part = next(split_batch(batch, micro))
        return planned_fixes(self.model, part, precision=self.precision,
                             activation_checkpointing=self.activation_checkpointing, device=self.accelerator.type,
                             smaller_batch=False)  # halving is the back-off's own move

    def _shrink(self, micro: int, total: int, ranks_failed: int, batch: Any) -> None:
        proposal = micro // 2
        if self.distributed:  # ranks may enter with different sizes after a restart: take the smallest
            value = torch.tensor([proposal], device=self._collective_device())
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
            proposal = int(value.item())
        if proposal < self.min_micro_batch_size:
            head = (f"Out of memory at micro-batch size {micro}, and halving it would go below "
                    f"min_micro_batch_size={self.min_micro_batch_size}. ")
            fixes = self.planned_fixes(batch, micro)
            raise OutOfMemoryAfterBackoffError(head + (fixes or (
                "The model, optimizer state or a single sample does not fit: use a smaller model, a lower "
                "precision (bf16-mixed), activation checkpointing, or more devices. "
                "`gpukit.memory.estimate_memory(...)` shows the breakdown.")))
        self.micro_batch_size = proposal
        self.accumulation_steps = math.ceil(total / proposal)
        event = BackoffEvent(self._calls, micro, proposal, self.accumulation_steps, ranks_failed)
        self.events.append(event)
        emit("oom_backoff", from_micro_batch=micro, to_micro_batch=proposal, ranks_failed=ranks_failed)
        first = not self._advised and (not self.distributed or dist.get_rank(self.group) == 0)  # one rank plans
        fixes = self.planned_fixes(batch, micro) if first else None
        self._advised = True
        log.warning("out of memory at micro-batch %d (%d rank(s)); retrying with micro-batch %d%s", micro, ranks_failed,
                    proposal, f". Instead of smaller micro-batches (more steps, same memory per item):\n{fixes}" if fixes else "")
        if self.on_backoff is not None:
            self.on_backoff(event)
