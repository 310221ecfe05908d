"""Session: one training loop (the user's own) on the CPU, one GPU, DataParallel, DDP, FSDP or a
split model; docs/sessions.md shows the loop. The facade holds its parts (``_parts``: what each is,
built from one :class:`~gpukit.session._config.SessionConfig`) and delegates to them.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from gpukit import memory as _memory
from gpukit.accelerators import Accelerator
from gpukit.data import DeviceLoader, TimingSummary, timed_progress
from gpukit.launch import LaunchSpec
from gpukit.monitor import MfuFigures
from gpukit.placement import to_device
from gpukit.precision import Precision
from gpukit.session._auto_decide import Decision
from gpukit.session._checks import not_launched_error
from gpukit.session._config import SessionConfig, with_arguments
from gpukit.session._first import main_process_first
from gpukit.session._fit import FitChoice
from gpukit.session._gather import all_gather_checked, gather_for_metrics
from gpukit.session._launch import launch_workers
from gpukit.session._loaders import join_uneven
from gpukit.session._memory import DEFAULT_WATCH_EVERY_N_STEPS
from gpukit.session._parts import build_parts
from gpukit.session._resume import ResumeInfo
from gpukit.session._schedulers import SessionScheduler
from gpukit.session._setup import set_up_loader, set_up_model
from gpukit.strategies import Strategy
from gpukit.worker import worker_env

__all__ = ["Session"]

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)


class Session:
    """Run a user-written training loop on the devices, strategy and precision asked for.

    Args:
        (every argument: typed, checked and documented once in
        :class:`~gpukit.session._config.SessionConfig`; ``help(Session)`` lists them here)

    Raises:
        ConfigurationError: an unknown or contradictory setting (the message lists the allowed).
        DeviceError: more devices than are visible, or a device type that is not here.
    """

    def __init__(
        self, devices: Any = "auto", precision: str | Precision = "auto",
        strategy: str | Strategy = "auto", seed: int | None = None, accumulate_grad_batches: int = 1,
        sync_batchnorm: bool = False, accelerator: str | Accelerator = "auto", verbose: bool = True,
        oom: str | None = None, watch_memory: bool | int = False,
        record: str | os.PathLike[str] | None = None, timeout_s: float | None = None,
        activation_checkpointing: Any = None, compile: bool | dict[str, Any] | None = None,
        fit: bool | str | int | None = None, *, seed_per_rank: bool = False,
        global_batch_size: int | None = None, micro_batch_size: int | None = None,
        step_at_loader_end: bool = True, log_with: Any = None, peak_tflops: float | None = None,
        flops_per_step: int | None = None, auto: bool = True, refuse: Iterable[str] = (),
        tensor_parallel: int | str = 1, tensor_plan: dict[str, Any] | None = None,
    ) -> None:
        # every argument as one checked value: what the parts read, and what launch() sends to the workers
        config = SessionConfig(
            devices=devices, precision=precision, strategy=strategy, seed=seed,
            accumulate_grad_batches=accumulate_grad_batches, sync_batchnorm=sync_batchnorm, accelerator=accelerator,
            verbose=verbose, oom=oom, watch_memory=watch_memory, record=record, timeout_s=timeout_s,
            activation_checkpointing=activation_checkpointing, compile=compile, fit=fit, seed_per_rank=seed_per_rank,
            global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
            step_at_loader_end=step_at_loader_end, log_with=log_with, peak_tflops=peak_tflops,
            flops_per_step=flops_per_step, auto=auto, refuse=refuse, tensor_parallel=tensor_parallel,
            tensor_plan=tensor_plan,
        )
        worker = worker_env()  # what a launcher told this process (a bad value raises here)
        self._config = config.for_worker(worker)
        parts = build_parts(self._config, worker)
        self.strategy: Strategy = parts.strategy
        self.accelerator: Accelerator = parts.strategy.accelerator
        self.seed = seed
        #: step-time breakdown of every gpukit loader (data wait, copy, compute); listeners
        self.timings = parts.timings
        #: the run recorder (``Session(record=...)``), ``None`` unless recording
        self.recorder = parts.services.recorder
        self._parts, self._fit, self._micro_batch_size = parts, parts.fit, parts.micro_batch_size
        self._loaders, self._steps, self._seeding, self._mfu = parts.loaders, parts.steps, parts.seeding, parts.mfu
        self._services, self._memory, self._runstate, self._auto = (parts.services, parts.memory, parts.runstate,
                                                                    parts.auto)

    # -- where this process sits -------------------------------------------------------------
    @property
    def precision(self) -> Precision:
        """The precision the session trains at: its strategy's (``Session(fit=...)`` may change it at setup)."""
        return self.strategy.precision

    @property
    def device(self) -> torch.device:
        """This process's device (the main GPU under DataParallel)."""
        self._require_launched("session.device")
        return self.strategy.root_device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0 -- the process that prints, logs and saves."""
        return self.strategy.rank == 0

    @property
    def auto_settings(self) -> list[Decision]:
        """Each automatic setting (``Session(auto=...)``): on or off and why; compile and cuda_graphs
        join after the first steps are measured."""
        return list(self._auto.decisions)

    @property
    def fit_choice(self) -> FitChoice | None:
        """What ``Session(fit=...)`` chose at ``setup`` (precision, checkpointing, micro-batch, peak)."""
        return self._fit and self._fit.choice

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step; settable between steps (after one that returned True)."""
        return self._steps.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:
        self._steps.accumulate_grad_batches = value

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward on one rank (``Session(micro_batch_size=...)``), ``None`` if not given."""
        return self._micro_batch_size

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks (micro x data-parallel ranks x accumulation), ``None`` if unknown."""
        return (self._micro_batch_size
                and self._micro_batch_size * self.strategy.data_parallel_size * self.accumulate_grad_batches)

    # -- set-up -----------------------------------------------------------------------------------
    def setup(self, model: M, optimizer: torch.optim.Optimizer | None = None, *, example_input: Any = None) -> Any:
        """Place, convert and wrap ``model``; check and move ``optimizer``. With ``Session(fit=...)``,
        first choose what was left open from ``example_input`` (one batch of the model's input).

        Returns:
            ``(model, optimizer)``, or the model alone when no optimizer is given. The model
            may be wrapped (DataParallel/DDP); ``gpukit.unwrap_model`` gives the inner one. Under a
            "-mixed" precision its forward runs under autocast (no ``session.autocast()`` needed)
            and returns 16-bit floating outputs in fp32.

        Raises:
            ConfigurationError: the optimizer holds parameters that are not the model's.
            DistributedError: several processes are needed but were not launched.
        """
        self._require_launched("session.setup()")
        return set_up_model(self._parts, model, optimizer, example_input, self._config.compile_options)

    def setup_dataloader(
        self, data: Any, batch_size: int | None = None, shuffle: bool | None = None,
        num_workers: int | str | None = None, even_batches: str | bool = "pad", **kwargs: Any,
    ) -> DeviceLoader:
        """A loader for this process: its shard of ``data``, batches on ``session.device``.

        Args:
            data: a Dataset or a DataLoader (its settings are kept unless overridden).
            batch_size: per process; default the loader's, else ``micro_batch_size``, else 1 (as torch).
            shuffle: default the loader's, or False for a dataset (as torch).
            num_workers: "auto" (default for a dataset): 0 for in-memory TensorDatasets and
                on the CPU, else usable CPUs per process - 1, at most 8; "tune": measured
                here (``gpukit.data.tune_loader``, cached), the same on every rank.
            even_batches: when the samples do not divide by the ranks: "pad" (default, or True:
                repeat a few so every rank gets as many; ``gather_for_metrics`` drops them),
                "drop" (leave the last ``N mod world_size`` out) or False (ranks may get different
                numbers of batches: iterate inside ``session.join(model)``). Rank 0 says which.
            **kwargs: ``drop_last``, ``pin_memory`` (default: on for GPUs),
                ``move_to_device`` (default True), ``data_timeout_s`` (longest wait for one
                batch before :class:`~gpukit.errors.DataStallError`, default 600) and any
                other DataLoader argument.

        Returns:
            A :class:`~gpukit.data.DeviceLoader`; each ``for`` over it is one epoch, with
            ``set_epoch`` handled, and ``state_dict()`` records the position for resuming.
        """
        self._require_launched("session.setup_dataloader()")
        return set_up_loader(self._parts, self.seed, data, batch_size, shuffle, num_workers, even_batches, **kwargs)

    def to_device(self, obj: T) -> T:
        """Move tensors/modules inside ``obj`` to ``session.device`` (see ``gpukit.to_device``)."""
        return to_device(obj, self.device)

    # -- the training step ------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for maths outside the set-up model at the session's precision (a loss head, a model
        not set up); the model ``setup`` returned autocasts by itself, and nesting costs nothing."""
        return self.precision.autocast()

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context that skips DDP's gradient sync except on the last micro-batch of a step."""
        return self._steps.accumulate(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation window's size and scaled for fp16; the
        loss is logged as ``loss`` (record, trackers) unless you log one yourself."""
        self._require_launched("session.backward()")
        self._seeding.check_first_loss(loss, self._loaders.current is not None, self.all_gather)
        self._steps.backward(loss, **kwargs)
        if self._services.logging:
            self._services.log_default({"loss": loss.detach()}, self._steps.micro_step)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> bool:
        """Count a micro-batch; at the end of an accumulation window (``accumulate_grad_batches``, or
        fewer at the end of a gpukit loader's pass) clip, step and zero the grads. Call it after every
        ``backward``. ``session.grad_norm`` is the norm before clipping (``math.inf``: measure only).

        Returns:
            True when the optimizer stepped; False inside a window and when fp16 found
            non-finite gradients (the step is skipped and the loss scale lowered).
        """
        self._mfu.before_step()  # the second step ends the FLOP count (a no-op once counted)
        stepped = self._steps.step(optimizer, clip_grad_norm)
        self._memory.after_step()  # leak check every n steps when watch_memory is on
        self._auto.after_step()  # measures a window of early steps once, then decides compile / CUDA graphs
        if clip_grad_norm is not None and self._steps.in_window == 0 and self._services.logging:
            self._services.log_default({"grad_norm": self._steps.grad_norm}, self._steps.micro_step - 1)
        return stepped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Total gradient norm of the last clipped step, before clipping (a tensor: no sync; FSDP: all
        shards; 16-mixed: unscaled, inf/nan when it skipped the step); ``None`` before one."""
        return self._steps.grad_norm

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted)."""
        return self._steps.optimizer_steps

    def setup_scheduler(self, scheduler: Any, interval: str = "step") -> SessionScheduler:
        """An LR scheduler whose ``step()``, called per batch, steps once per optimizer step (``_schedulers``)."""
        wrapped = SessionScheduler(scheduler, self._steps, interval)
        self._runstate.schedulers.append(wrapped)
        return wrapped

    def log(self, **scalars: Any) -> None:
        """Record scalars (``loss=loss``) for this step: numbers or one-element tensors, kept
        without a GPU sync; sent to the run record (``record=``, with TensorBoard) and the
        trackers (``log_with=``), checked even when neither is on."""
        self._services.log(scalars, self._steps.micro_step)

    def init_trackers(self, run_name: str | None = None, config: dict[str, Any] | None = None) -> None:
        """Name the trackers' run and log ``config`` once (with the session's settings), before the loop."""
        self._services.trackers.init(run_name, config)

    def log_event(self, kind: str, **fields: Any) -> None:
        """Record an event of your own, e.g. ``log_event("checkpoint", path=str(path))`` after
        ``gpukit.save``: listed and marked in the report. Checked even when not recording."""
        from gpukit.monitor import log_event

        log_event(self.recorder, kind, fields)

    # -- memory (SessionMemory) -------------------------------------------------------------------
    def run_step(
        self, step_fn: Callable[[Any], torch.Tensor], batch: Any, *, model: nn.Module | None = None
    ) -> torch.Tensor:
        """Forward and backward of one batch, ``loss = step_fn(batch)``, with the ``oom=`` policy
        (``"backoff"``: split a batch that does not fit). Returns the loss, detached. See
        :meth:`SessionMemory.run_step <gpukit.session._memory.SessionMemory.run_step>`."""
        self._require_launched("session.run_step()")
        if self._mfu.pending:  # the second run_step is a step the FLOP count can hold whole
            return self._mfu.count_run_step(lambda: self._memory.run_step(step_fn, batch, model=model))
        return self._memory.run_step(step_fn, batch, model=model)

    @property
    def oom_backoff(self) -> _memory.OomBackoff | None:
        """The back-off state with ``oom="backoff"`` (``micro_batch_size`` -- ``None`` until the
        first out-of-memory --, ``accumulation_steps``, ``events``); ``None`` otherwise."""
        return self._memory.oom_backoff

    def watch_memory(self, every_n_steps: int = DEFAULT_WATCH_EVERY_N_STEPS, **options: Any) -> _memory.LeakWatcher:
        """Check for memory leaks every ``every_n_steps`` calls of ``session.step`` (names the
        variable behind ``total_loss += loss``); returns the :class:`~gpukit.memory.LeakWatcher`."""
        self._require_launched("session.watch_memory()")
        return self._memory.watch_memory(every_n_steps, **options)

    def memory_report(self) -> _memory.MemoryReport:
        """Memory of this session's device (see :func:`gpukit.memory_report`)."""
        return self._memory.memory_report()

    def free_memory(self) -> int | None:
        """Collect garbage and return cached blocks of ``session.device`` to the driver (between
        phases, not every step). Returns the bytes given back; ``None`` on the CPU."""
        return self._memory.free_memory()

    # -- stopping and checkpoints (RunState) -------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM/SIGINT under ``gpukit run``: preemption).

        Check it once per step, after ``session.step``; every rank gets the same answer at the
        same step (one small all-reduce), so all ranks can save a checkpoint and leave the loop
        together. ``gpukit run`` then exits with ``gpukit.launch.PREEMPTED_EXIT_CODE`` (75).
        """
        return self._runstate.should_stop()

    def save_checkpoint(
        self, directory: str | os.PathLike[str], step: int, *, keep_last: int = 3,
        extra: dict[str, Any] | None = None, background: bool = False, **objects: Any,
    ) -> Any:
        """Save the full training state of ``step`` (call on every rank; rank 0 writes shared state).

        ``objects`` are models, optimizers, schedulers and loaders by name; the session's own
        state (GradScaler, step counters) and every rank's RNG and loader position are added.
        ``background=True`` returns once the state is copied to host memory and writes it in a
        background thread (one save in flight; ``close``, ``resume`` and exit wait for it; a
        failure is raised by the next call). See :class:`gpukit.CheckpointManager`. Returns the
        step directory written (with ``background``: where it will be).
        """
        return self._runstate.save_checkpoint(directory, step, keep_last=keep_last, extra=extra,
                                              background=background, **objects)

    def resume(self, directory: str | os.PathLike[str], **objects: Any) -> int | None:
        """Restore ``objects`` and this session from the latest complete checkpoint in ``directory``;
        rank 0 says what it resumed from (or that there was nothing), when verbose.

        Returns:
            The step it resumed from, or ``None`` when ``directory`` has no checkpoint yet; the
            saved ``extra`` values are in ``session.resumed.extra``.
        """
        return self._runstate.resume(directory, **objects)

    @property
    def resumed(self) -> ResumeInfo | None:
        """The last resume's ``step``, ``path``, ``extra`` (``save_checkpoint(extra=...)``), loader ``epoch``/``batch``."""
        return self._runstate.resumed

    def state_dict(self) -> dict[str, Any]:
        """Session-owned training state: step counters, GradScaler, and the micro-batch size OOM
        back-off settled on (so a resumed run does not run out again)."""
        return self._runstate.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._runstate.load_state_dict(state)

    # -- output (rank 0 only) -----------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

    def progress(self, iterable: Iterable[T], total: int | None = None, description: str = "") -> Iterator[T]:
        """Iterate ``iterable`` with a live bar (samples/s, data share) drawn on rank 0 only."""
        bar = timed_progress(iterable, self.timings, total=total, description=description, enabled=self.is_main)
        return self._steps.warn_pending_at_end(bar, iterable)  # a plain iterable: its end is seen here

    def throughput(self) -> TimingSummary:
        """Samples/s, steps/s and where step time went so far (see ``session.timings``)."""
        return self.timings.throughput()

    @property
    def mfu(self) -> MfuFigures | None:
        """Achieved TFLOP/s and MFU of the last epoch of a gpukit loader (``None`` before one ends, or
        while the FLOPs per step are not known); ``session.flops_per_step`` is the count."""
        return self._mfu.last

    @property
    def flops_per_step(self) -> int | None:
        """Floating-point operations of one micro-batch's step on this process: given, or counted on
        the second step (``None`` until then)."""
        return self._mfu.flops_per_step

    # -- collectives (identity in a single process) -----------------------------------------------
    def barrier(self) -> None:
        """Wait until every process reaches this point."""
        self._require_launched("session.barrier()")
        self.strategy.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        """``obj`` as process ``src`` has it, on every process (tensor or picklable object)."""
        self._require_launched("session.broadcast()")
        return self.strategy.broadcast(obj, src)

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """``value`` reduced over processes with "mean", "sum", "max" or "min" (a new tensor)."""
        self._require_launched("session.all_reduce()")
        return self.strategy.all_reduce(value, op)

    def all_gather(self, value: torch.Tensor | float) -> torch.Tensor:
        """Every process's ``value`` stacked along a new dim 0 of size ``world_size``; shapes that
        differ between ranks raise DistributedError on every rank (not an abort inside gloo)."""
        self._require_launched("session.all_gather()")
        return all_gather_checked(self.strategy, value)

    def gather_for_metrics(self, value: Any, pad_index: Any = None) -> Any:
        """Every rank's ``value`` (samples along dim 0; nested; lists of objects) joined into exactly the
        dataset's samples in the loader's order, padding repeats dropped (see ``_gather``)."""
        self._require_launched("session.gather_for_metrics()")
        return gather_for_metrics(self.strategy, self._loaders, value, pad_index)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context for ranks with different numbers of batches (``even_batches=False``; DDP: torch's Join)."""
        return join_uneven(self._loaders, self.strategy, model)

    def main_process_first(self, local: bool = False) -> contextlib.AbstractContextManager[None]:
        """Run the block on rank 0 first (``local``: each node's first), then the others (see ``_first``)."""
        self._require_launched("session.main_process_first()")
        return main_process_first(self.strategy, local)

    # -- processes -----------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """Run ``fn(session, *args)`` in every process this session needs; returns ``fn``'s values
        in rank order (just this process's when already launched or single-process).

        Processes not running yet (plain ``python``, devices > 1) are started through PyTorch's
        elastic launcher (as ``gpukit run``), an equal session in each; ``fn`` and ``args`` must
        pickle (``fn`` at module level). In a notebook, where ``fn`` is defined in a cell, the
        workers are forked from this process (``gpukit.launch._notebook``)."""
        if self.strategy.launched:
            return [fn(self, *args)]
        spec = LaunchSpec(nproc=self.strategy.num_processes, cpu=self.accelerator.is_host)
        return launch_workers(type(self), self._config, fn, args, spec)

    def close(self) -> None:
        """Wait for a background checkpoint save still writing (raising its failure), then leave the
        process group this session joined, and finish the record and trackers (at the end of training)."""
        self._steps.warn_if_pending("session.close()")
        try:
            self._runstate.wait_for_saves()
        finally:
            self._mfu.close()
            self._memory.close()
            self._services.close()
            self.strategy.teardown()

    def _require_launched(self, what: str) -> None:
        if not self.strategy.launched:
            raise not_launched_error(what, self.strategy, self._config.devices)

    def __repr__(self) -> str:
        state = self.strategy.describe() if self.strategy.launched else "not launched"
        return f"Session({state}, precision={self.precision.name!r})"


Session.__doc__ = with_arguments(Session.__doc__)  # help(Session) lists every argument, from SessionConfig
