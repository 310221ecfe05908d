"""The Session's parts, built in order from its :class:`~gpukit.session._config.SessionConfig`.

The facade delegates to them: ``strategy``, ``precision`` and ``accelerator`` (how the model is wrapped,
how the maths runs, what the device is) and four components -- :class:`~gpukit.session._steps.TrainingSteps`
(backward, gradient accumulation, the optimizer step), :class:`~gpukit.session._services.SessionServices`
(stop signals, heartbeat, requeue, the run record, the trackers), :class:`~gpukit.session._memory.SessionMemory`
(``run_step`` with OOM back-off, leak watching) and :class:`~gpukit.session._runstate.RunState`
(``should_stop``, saving and resuming checkpoints, the state they carry). Smaller parts: the loader
tracker (``_loaders``: the batch in hand, ``join``), MFU (``_mfu``), automatic settings (``_auto``),
fit (``_fit``), seeding (``_seeding``); and, used by the facade's methods, gathering (``_gather``),
schedulers (``_schedulers``), ``main_process_first`` (``_first``), batch sizes (``_batching``), the model
and loader set-up (``_setup``).

:func:`build_parts` is ``Session.__init__``'s wiring: the strategy (which owns the precision and the
accelerator), then each component with the objects it needs -- the order matters (the seed before
the process group, the requeue hook before it too, the process group before the services that
announce the job and open the run record).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpukit.data import StepTimings
from gpukit.precision import get_precision
from gpukit.session._auto import SessionAuto, loader_steps, say_on
from gpukit.session._batching import plan_batches, restarted_job
from gpukit.session._checks import choice_banner
from gpukit.session._fit import SessionFit
from gpukit.session._loaders import LoaderTracker
from gpukit.session._memory import SessionMemory
from gpukit.session._mfu import SessionMfu
from gpukit.session._runstate import RunState
from gpukit.session._seeding import RankSeeding, seed_everything
from gpukit.session._services import SessionServices
from gpukit.session._steps import TrainingSteps
from gpukit.strategies import Strategy, configure_strategy, select_strategy
from gpukit.worker import requeue_at_exit

if TYPE_CHECKING:
    from gpukit.session._config import SessionConfig
    from gpukit.worker import WorkerEnv

__all__ = ["SessionParts", "build_parts"]


@dataclass
class SessionParts:
    """What a Session holds and delegates to (see ``gpukit.session._session``'s module docstring)."""

    strategy: Strategy
    fit: SessionFit | None
    micro_batch_size: int | None
    loaders: LoaderTracker
    steps: TrainingSteps
    seeding: RankSeeding
    timings: StepTimings
    mfu: SessionMfu
    services: SessionServices
    memory: SessionMemory
    runstate: RunState
    auto: SessionAuto


def build_parts(config: SessionConfig, worker: WorkerEnv) -> SessionParts:
    """Build the strategy and every component of a Session from ``config`` (checked) in this process.

    Args:
        config: the Session's arguments, as this process runs them (:meth:`SessionConfig.for_worker`).
        worker: what a launcher told this process.

    Raises:
        ConfigurationError: a setting that does not fit the machine or the strategy.
        DeviceError: more devices than are visible, or a device type that is not here.
    """
    verbose = config.verbose
    strategy = select_strategy(config.devices, config.strategy, config.accelerator,
                               sync_batchnorm=config.sync_batchnorm, tensor_parallel=config.tensor_parallel,
                               tensor_plan=config.tensor_plan)
    configure_strategy(strategy, config.activation_checkpointing, verbose=verbose)
    if config.collective_timeout_s is not None:  # before setup_environment creates the process group
        strategy.timeout_s = config.collective_timeout_s
    accelerator = strategy.accelerator
    # the strategy owns the precision; every component reads it there (Session(fit=) may change it)
    strategy.precision = get_precision(
        SessionAuto.precision_name(config.precision, config.auto_on, config.refused, accelerator,
                                   strategy.root_device, loss_scaling=strategy.loss_scaling),
        accelerator, strategy.root_device)
    fit = SessionFit.create(config.fit, config, strategy, verbose=verbose)
    # data-parallel coordinates (not rank / world size): the ranks of one tensor group share a batch
    batches = plan_batches(config.global_batch_size, config.micro_batch_size, config.accumulate_grad_batches,
                           strategy.data_parallel_size, restarted=restarted_job())
    loaders = LoaderTracker(strategy.data_parallel_size)  # the gpukit loader whose batch is in hand
    steps = TrainingSteps(strategy, batches.accumulate_grad_batches, loaders=loaders,
                          step_at_loader_end=config.step_at_loader_end)
    loaders.on_pass_end = steps.pass_ended
    seeding = RankSeeding(config.seed, strategy.data_parallel_rank, strategy.data_parallel_size, accelerator,
                          config.seed_per_rank)
    timings = StepTimings(accelerator, rank=strategy.rank, report=verbose)
    timings.shows_pass = steps.trained_this_pass  # epoch lines for training passes only
    # FLOPs per step (counted on the first) and MFU in each epoch's line and the record
    mfu = SessionMfu(config.peak_tflops, config.flops_per_step, strategy=strategy, accelerator=accelerator,
                     timings=timings, loaders=loaders, steps=steps)
    if config.seed is not None:
        seed_everything(config.seed, accelerator)
    # `srun python`: rank 0 requeues a job stopped by --signal, at exit -- after the process
    # group is left, so armed before it exists (exit hooks run last-registered first)
    requeue_at_exit()
    # refuses what the strategy cannot do (oom='backoff' under FSDP or tensor groups) before a process group exists
    memory = SessionMemory(config.oom, config.watch_every_n_steps, strategy=strategy, accelerator=accelerator,
                           steps=steps)
    if strategy.launched:
        strategy.setup_environment()
    try:
        services = SessionServices(  # stop signals, heartbeat, the run record, the trackers
            strategy=strategy, accelerator=accelerator, timings=timings, config=config, worker=worker,
            accumulate_grad_batches=steps.accumulate_grad_batches,
        )
    except BaseException:
        strategy.teardown()  # a refused Session leaves no process group behind (the next one could not start)
        raise
    mfu.recorder = services.recorder
    runstate = RunState(strategy=strategy, steps=steps, memory=memory, verbose=verbose,
                        micro_batch_size=batches.micro_batch_size,
                        global_batch_given=config.global_batch_size is not None)
    is_main = strategy.rank == 0
    auto = SessionAuto(config.auto_on, config.refused, strategy, config.precision, config.compile,
                       loader_steps(loaders), say_on() if verbose and is_main else None)
    if strategy.launched and verbose and is_main:
        print(choice_banner(strategy, strategy.precision, config), file=sys.stderr)
    return SessionParts(strategy=strategy, fit=fit, micro_batch_size=batches.micro_batch_size, loaders=loaders,
                        steps=steps, seeding=seeding, timings=timings, mfu=mfu, services=services, memory=memory,
                        runstate=runstate, auto=auto)
