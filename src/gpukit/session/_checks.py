"""What the Session checks and starts around it, kept out of ``session.py`` (the facade).

* :func:`start_process_services`: the per-process wiring every Session needs -- stop signals
  become ``session.should_stop``, a heartbeat lets ``gpukit run`` name a rank that stalls,
  ``srun python`` jobs requeue themselves, and the cluster it runs in is announced once;
* :func:`check_optimizer` and :func:`not_launched_error`: the set-up errors, with their fixes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigurationError, DistributedError
from gpukit.placement import unwrap_model

__all__ = ["check_optimizer", "not_launched_error", "start_process_services"]


def start_process_services(strategy: Any, verbose: bool) -> None:
    """Install the stop-signal handler, the heartbeat (when launched), requeue-at-exit and
    the one-line cluster announcement (rank 0, when verbose)."""
    from gpukit.launch._preemption import (
        install_preemption_handler,
        session_stop_signals,
    )
    from gpukit.launch._requeue import requeue_at_exit

    from gpukit.launch._notebook import is_kernel

    if not is_kernel():  # a notebook kernel keeps its own SIGTERM (and its forked workers inherit none)
        install_preemption_handler(session_stop_signals())  # SIGTERM becomes `should_stop`
    if strategy.launched:  # under gpukit run: the launcher names a rank that stalls
        from gpukit.launch._heartbeat import start_heartbeat

        start_heartbeat(strategy.rank, strategy.world_size)
    requeue_at_exit()  # `srun python`: rank 0 requeues a job stopped by --signal, at exit
    if verbose:
        from gpukit.cluster import announce

        announce()  # once, rank 0: the SLURM / Kubernetes job this process belongs to


def not_launched_error(what: str, strategy: Any, devices: Any) -> DistributedError:
    """The error for ``what`` called in one process when the strategy needs several."""
    n = strategy.num_processes
    run = (
        f"gpukit run --cpu --nproc {n} script.py"
        if strategy.accelerator.is_host
        else f"gpukit run --gpus {n} script.py"
    )
    return DistributedError(
        f"{what} needs {n} processes (strategy {strategy.name!r}, devices={devices!r}), but "
        "this is one process started without a launcher (no RANK/WORLD_SIZE in its "
        "environment); gpukit will not silently train on one device. Start the "
        f"{n} processes in one of these ways:\n"
        f"  - put the training in a function and call session.launch(train_fn);\n"
        f"  - {run};\n"
        f"  - torchrun --nproc-per-node {n} script.py.\n"
        "Or ask for one device: Session(devices=1)."
    )


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"setup(model, optimizer) got a {type(optimizer).__name__} as optimizer; pass a "
            "torch.optim.Optimizer (or call setup(model) alone)."
        )
    owned = {id(p) for p in unwrap_model(model).parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ConfigurationError(
            f"The optimizer holds {len(foreign)} parameter tensor(s) that are not parameters of "
            f"the model given to setup (shapes {shapes}{', ...' if len(foreign) > 5 else ''}). "
            "Build the optimizer from this model, e.g. torch.optim.SGD(model.parameters(), ...), "
            "after creating (or loading) the model and before session.setup."
        )
