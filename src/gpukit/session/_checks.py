"""The Session's set-up errors, with their fixes: :func:`check_optimizer` (an optimizer that is not the model's) and :func:`not_launched_error`
(several processes needed, one running)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpukit.errors import ConfigurationError, DistributedError
from gpukit.placement import unwrap_model

if TYPE_CHECKING:
    from gpukit.session._config import SessionConfig

__all__ = ["check_optimizer", "choice_banner", "not_launched_error"]


def choice_banner(strategy: Any, precision: Any, config: SessionConfig) -> str:
    """The line a verbose Session prints on rank 0: what it chose, and what was chosen for the user."""
    auto = {k: ", chosen automatically" if given == "auto" else ""
            for k, given in (("strategy", config.strategy), ("precision", config.precision))}
    fit = "; fit chooses what is left open at setup" if config.fit not in (None, False) else ""
    return (f"gpukit: strategy {strategy.describe()}{auto['strategy']}; "
            f"precision {precision.name}{auto['precision']}{fit}")


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
