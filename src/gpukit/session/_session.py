"""Session: one training loop for the CPU, one GPU, DataParallel and DDP.

The session holds three objects -- an accelerator (what the device is), a strategy (how the
model is placed and kept in sync) and a precision (how the maths runs) -- and its methods
delegate to them. Users keep their own loop::

    session = gpukit.Session(precision="auto", accumulate_grad_batches=2, seed=0)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(dataset, batch_size=64, shuffle=True)
    for epoch in range(3):
        for x, y in session.progress(loader):
            with session.accumulate(model):
                with session.autocast():
                    loss = loss_fn(model(x), y)
                session.backward(loss)
            session.step(optimizer, clip_grad_norm=1.0)
Memory methods (``run_step`` with OOM back-off, ``watch_memory``...) live in ``gpukit.session._memory``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from gpukit._util.seeding import fresh_seed, seed_everything
from gpukit.session._checks import (
    check_optimizer,
    not_launched_error,
    start_process_services,
)
from gpukit.session._memory import SessionMemoryMixin
from gpukit.session._runstate import SessionRunStateMixin
from gpukit._util.timeouts import parse_timeout_s
from gpukit.accelerators import Accelerator
from gpukit.data import DeviceLoader, StepTimings, TimingSummary, build_loader
from gpukit.data._timing import timed_progress
from gpukit.errors import ConfigurationError
from gpukit.monitor._record import Recorder, session_recorder
from gpukit.placement import to_device
from gpukit.precision import Precision, get_precision
from gpukit.strategies import Strategy, select_strategy
from gpukit.strategies._checkpointing import configure_strategy
from gpukit.strategies._compile import check_compile, compile_module, compile_request

__all__ = ["Session"]

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)


class Session(SessionMemoryMixin, SessionRunStateMixin):
    """Run a user-written training loop on the devices, strategy and precision asked for.

    Args:
        devices: "auto" (one device per process), an int N (-1: all visible GPUs), a list of
            GPU indices, or one device ("cpu", "cuda:1", a torch.device). On the CPU,
            ``accelerator="cpu", devices=N`` means N processes (DDP on gloo).
        precision: "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true" or "auto".
        strategy: "auto", "single", "dp", "ddp", "fsdp" (sharded over processes;
            ``FSDPStrategy(auto_wrap=..., cpu_offload=True)`` for other settings) or "pipeline"
            (layers split over ``devices`` in one process; ``PipelineStrategy(devices, chunks=4)``
            for micro-batches), or a Strategy.
        seed: seeds Python, NumPy, torch, every GPU, shuffling and loader workers.
        accumulate_grad_batches: micro-batches per optimizer step.
        sync_batchnorm: under DDP, compute BatchNorm statistics over the global batch.
        accelerator: "auto", "cpu", "cuda" or "mps".
        verbose: print (on rank 0) what was chosen.
        oom: out of memory in ``run_step``: None (propagates), "raise" (post-mortem, then
            StepOutOfMemoryError) or "backoff" (halve the micro-batch and retry).
        watch_memory: True or a step interval: ``watch_memory(every_n_steps)`` at start.
        record: a directory for the run record (per-step timings, ``session.log`` scalars, system
            samples, events; ``gpukit report DIR`` plots it); default ``GPUKIT_RECORD_DIR`` or none.
        timeout_s: how long a collective waits for a rank that stopped before it raises;
            default ``GPUKIT_TIMEOUT_S`` (``gpukit run --timeout``) or 1800.
        activation_checkpointing: recompute blocks' activations in backward instead of keeping
            them: True (every block), "selective" (every other block), a set of module classes
            or a callable ``(module, name) -> bool``; works with every strategy (see docs/memory.md).
        compile: True or a dict of ``torch.compile`` options: ``setup`` compiles the model the
            way the strategy needs (the DDP wrapper, each FSDP unit). A ``torch.compile(model)``
            given to ``setup`` is compiled the same way with its own settings, not dropped.

    Raises:
        ConfigurationError: an unknown or contradictory setting (the message lists the allowed).
        DeviceError: more devices than are visible, or a device type that is not here.
    """

    def __init__(
        self,
        devices: Any = "auto",
        precision: str | Precision = "auto",
        strategy: str | Strategy = "auto",
        seed: int | None = None,
        accumulate_grad_batches: int = 1,
        sync_batchnorm: bool = False,
        accelerator: str | Accelerator = "auto",
        verbose: bool = True,
        oom: str | None = None,
        watch_memory: bool | int = False,
        record: str | os.PathLike[str] | None = None,
        timeout_s: float | None = None,
        activation_checkpointing: Any = None,
        compile: bool | dict[str, Any] | None = None,
    ) -> None:
        if (
            not isinstance(accumulate_grad_batches, int)
            or isinstance(accumulate_grad_batches, bool)
            or accumulate_grad_batches < 1
        ):
            raise ConfigurationError(
                f"accumulate_grad_batches={accumulate_grad_batches!r}; use an int >= 1."
            )
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise ConfigurationError(f"seed={seed!r}; use an int or None (ints from 0 to 2**63 - 1).")
        self._init_memory(oom, watch_memory, sync_batchnorm)  # checks them before any set-up
        if accelerator == "auto" and os.environ.get("GPUKIT_CPU") == "1":
            accelerator = "cpu"  # `gpukit run --cpu`: gloo on the CPU even where GPUs exist
        # what a worker started by launch() needs to build the same session
        self._config = dict(
            devices=devices, precision=precision, strategy=strategy, seed=seed,
            accumulate_grad_batches=accumulate_grad_batches, sync_batchnorm=sync_batchnorm,
            accelerator=accelerator, verbose=verbose, oom=oom, watch_memory=watch_memory, record=record,
            timeout_s=timeout_s, activation_checkpointing=activation_checkpointing,
            compile=compile,
        )
        self._compile = check_compile(compile)
        self.strategy: Strategy = select_strategy(
            devices, strategy, accelerator, sync_batchnorm=sync_batchnorm
        )
        configure_strategy(self.strategy, activation_checkpointing, verbose=verbose)
        if timeout_s is not None:  # before setup_environment creates the process group
            self.strategy.timeout_s = parse_timeout_s(timeout_s)
        self.accelerator: Accelerator = self.strategy.accelerator
        self.precision: Precision = get_precision(
            precision, self.accelerator, self.strategy.root_device
        )
        self.strategy.precision = self.precision
        self.accumulate_grad_batches = accumulate_grad_batches
        self.seed = seed
        #: step-time breakdown of every gpukit loader (data wait, copy, compute); listeners
        self.timings = StepTimings(self.accelerator, rank=self.strategy.rank, report=verbose)
        self._micro_step = 0
        self._optimizer_steps = 0
        if seed is not None:
            seed_everything(seed, self.accelerator)
        if self.strategy.launched:
            self.strategy.setup_environment()
        start_process_services(self.strategy, verbose)  # stop signals, heartbeat, requeue
        self.recorder: Recorder | None = session_recorder(self, record)  # None unless recording
        if self.strategy.launched:
            if verbose and self.is_main:
                auto = {
                    k: ", chosen automatically" if self._config[k] == "auto" else ""
                    for k in self._config
                }
                print(
                    f"gpukit: strategy {self.strategy.describe()}{auto['strategy']}; "
                    f"precision {self.precision.name}{auto['precision']}",
                    file=sys.stderr,
                )

    # -- where this process sits -------------------------------------------------------------
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

    # -- set-up -----------------------------------------------------------------------------------
    def setup(self, model: M, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Place, convert and wrap ``model``; check and move ``optimizer``.

        Returns:
            ``(model, optimizer)``, or the model alone when no optimizer is given. The model
            may be wrapped (DataParallel/DDP); ``gpukit.unwrap_model`` gives the inner one.

        Raises:
            ConfigurationError: the optimizer holds parameters that are not the model's.
            DistributedError: several processes are needed but were not launched.
        """
        self._require_launched("session.setup()")
        if optimizer is not None:
            check_optimizer(model, optimizer)
        model, compiling = compile_request(model, self._compile)  # a torch.compile wrapper comes off here
        model = self.strategy.prepare_module(model)
        model = self.precision.convert_module(model)
        model = self.strategy.setup_module(model)
        model = compile_module(self.strategy, model, compiling)  # ... and goes back on what the strategy built
        self._memory_track_model(model)  # inference guard; run_step's default model
        if optimizer is None:
            return model
        optimizer = self.strategy.setup_optimizer(model, optimizer)  # FSDP: the sharded params
        if optimizer.state:
            # the optimizer's own loader casts state to each parameter's device and dtype
            # (and keeps Adam's "step" counters where they belong)
            optimizer.load_state_dict(optimizer.state_dict())
        return model, optimizer

    def setup_dataloader(
        self,
        data: Any,
        batch_size: int | None = None,
        shuffle: bool | None = None,
        num_workers: int | str | None = None,
        **kwargs: Any,
    ) -> DeviceLoader:
        """A loader for this process: its shard of ``data``, batches on ``session.device``.

        Args:
            data: a Dataset or a DataLoader (its settings are kept unless overridden).
            batch_size: per process; default the loader's, or 1 for a dataset (as torch).
            shuffle: default the loader's, or False for a dataset (as torch).
            num_workers: "auto" (default for a dataset): 0 for in-memory TensorDatasets and
                on the CPU, else usable CPUs per process - 1, at most 8; "tune": measured
                here (``gpukit.data.tune_loader``, cached), the same on every rank.
            **kwargs: ``drop_last``, ``pin_memory`` (default: on for GPUs),
                ``move_to_device`` (default True), ``data_timeout_s`` (longest wait for one
                batch before :class:`~gpukit.errors.DataStallError`, default 600) and any
                other DataLoader argument.

        Returns:
            A :class:`~gpukit.data.DeviceLoader`; each ``for`` over it is one epoch, with
            ``set_epoch`` handled, and ``state_dict()`` records the position for resuming.
        """
        self._require_launched("session.setup_dataloader()")
        seed = self.seed
        if seed is None:  # random order per run, recorded in the loader's state_dict
            seed = self.broadcast(fresh_seed()) if self.world_size > 1 else fresh_seed()
        return build_loader(
            data, device=self.device, accelerator=self.accelerator, rank=self.rank,
            world_size=self.world_size, local_world_size=self.strategy.num_processes,
            seed=int(seed), batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
            timings=self.timings, broadcast=self.broadcast, **kwargs,
        )

    def to_device(self, obj: T) -> T:
        """Move tensors/modules inside ``obj`` to ``session.device`` (see ``gpukit.to_device``)."""
        return to_device(obj, self.device)

    # -- the training step ------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for the forward pass and loss at the session's precision."""
        return self.precision.autocast()

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context that skips DDP's gradient sync except on the last micro-batch of a step."""
        if (self._micro_step + 1) % self.accumulate_grad_batches == 0:
            return contextlib.nullcontext()
        return self.strategy.no_backward_sync(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by ``accumulate_grad_batches`` and scaled for fp16."""
        self._require_launched("session.backward()")
        if self.accumulate_grad_batches > 1:
            # summed over the micro-batches this gives the gradient of the mean loss
            loss = loss / self.accumulate_grad_batches
        self.precision.scale_loss(loss).backward(**kwargs)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> bool:
        """Count a micro-batch; on the accumulation boundary clip, step and zero the grads.

        Call it after every ``backward``, with the session's one optimizer.

        Returns:
            True when the optimizer stepped; False between boundaries and when fp16 found
            non-finite gradients (the step is skipped and the loss scale lowered).
        """
        self._micro_step += 1
        stepped = False
        if self._micro_step % self.accumulate_grad_batches == 0:
            if clip_grad_norm is not None:
                self.precision.unscale_(optimizer)
                self.strategy.clip_gradients(optimizer, clip_grad_norm)
            stepped = self.precision.optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            self._optimizer_steps += int(stepped)
        self._memory_after_step()  # leak check every n steps when watch_memory is on
        return stepped

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted)."""
        return self._optimizer_steps

    def log(self, **scalars: Any) -> None:
        """Record scalars (``loss=loss``) for this step: numbers or one-element tensors, kept
        without a GPU sync; a no-op unless recording (``record=``), also sent to TensorBoard."""
        if self.recorder is not None:
            self.recorder.log(**scalars)

    # -- output (rank 0 only) -----------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

    def progress(
        self, iterable: Iterable[T], total: int | None = None, description: str = ""
    ) -> Iterator[T]:
        """Iterate ``iterable`` with a live bar (samples/s, data share) drawn on rank 0 only."""
        return timed_progress(iterable, self.timings, total=total, description=description,
                              enabled=self.is_main)

    def throughput(self) -> TimingSummary:
        """Samples/s, steps/s and where step time went so far (see ``session.timings``)."""
        return self.timings.throughput()

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
        """Every process's ``value`` stacked along a new dim 0 of size ``world_size``."""
        self._require_launched("session.all_gather()")
        return self.strategy.all_gather(value)

    # -- processes -----------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., T], *args: Any) -> list[T]:
        """Run ``fn(session, *args)`` in every process this session needs.

        When the processes are not running yet (plain ``python`` with devices > 1), starts
        them through PyTorch's elastic launcher (as ``gpukit run`` does) and builds an equal
        session in each. ``fn`` and ``args`` must be picklable (``fn`` defined at module level).
        Otherwise ``fn`` runs here, once.

        Returns:
            ``fn``'s return values, one per rank in rank order (just this process's when
            already launched or single-process).
        """
        if self.strategy.launched:
            return [fn(self, *args)]
        from gpukit.launch import launch_function

        return list(
            launch_function(
                _run_worker, (self._config, fn, args),
                nproc=self.strategy.num_processes, cpu=self.accelerator.is_host,
            )
        )

    def close(self) -> None:
        """Leave the process group this session joined (at the end of training)."""
        self._memory_close()
        if self.recorder is not None:
            self.recorder.close()
        self.strategy.teardown()

    def _require_launched(self, what: str) -> None:
        if not self.strategy.launched:
            raise not_launched_error(what, self.strategy, self._config["devices"])

    def __repr__(self) -> str:
        state = self.strategy.describe() if self.strategy.launched else "not launched"
        return f"Session({state}, precision={self.precision.name!r})"


def _run_worker(config: dict[str, Any], fn: Callable[..., Any], args: tuple) -> Any:
    """Entry point of a process started by :meth:`Session.launch`."""
    session = Session(**config)
    try:
        return fn(session, *args)
    finally:
        session.close()
