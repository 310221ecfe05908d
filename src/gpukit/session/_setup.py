"""What ``session.setup`` and ``session.setup_dataloader`` do, in order, with the Session's parts.

:func:`set_up_model` is the one order a model goes through (fit's choice, compile's request, the
meta device, the strategy's preparation, the precision, the automatic settings, the wrapper, the
autocast forward, compilation); :func:`set_up_loader` builds this process's shard of the data on the
session's device, at the data-parallel coordinates (the ranks of one tensor group see the same batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpukit.data import DeviceLoader, LoaderPlace, LoaderRequest, build_loader
from gpukit.errors import ConfigurationError
from gpukit.session._checks import check_optimizer
from gpukit.session._fit import fit_at_setup
from gpukit.session._seeding import fresh_seed
from gpukit.strategies import compile_module, compile_request

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gpukit.session._parts import SessionParts

__all__ = ["set_up_loader", "set_up_model"]


def set_up_model(parts: SessionParts, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 example_input: Any, compile_options: dict[str, Any] | None) -> Any:
    """``session.setup(model, optimizer, example_input=...)`` (documented there) in a launched session.

    Returns:
        ``(model, optimizer)``, or the model alone when no optimizer is given.

    Raises:
        ConfigurationError: the optimizer holds parameters that are not the model's.
    """
    strategy = parts.strategy
    if optimizer is not None:
        check_optimizer(model, optimizer)
    if parts.fit is not None or example_input is not None:  # Session(fit=...): choose before wrapping
        was = strategy.precision.name
        fit_at_setup(parts.fit, model, optimizer, example_input, memory=parts.memory,
                     regroup=lambda degree: _regroup(parts, degree))
        if strategy.precision.name != was:  # the record's header and the trackers said the one before
            parts.services.precision_chosen(strategy.precision.name, was)
    model, compiling = compile_request(model, compile_options)  # a torch.compile wrapper comes off here
    model = strategy.materialise_meta(model)  # built on the meta device: allocated, initialised
    model = strategy.prepare_module(model)
    model = strategy.precision.convert_module(model)
    model = parts.auto.before_wrap(model, optimizer, compiled=compiling is not None)  # Session(auto=...)
    model = strategy.setup_module(model)
    model = strategy.run_at_precision(model)  # "-mixed": the forward autocasts without session.autocast()
    model = compile_module(strategy, model, compiling)  # ... and goes back on what the strategy built
    parts.memory.track_model(model)  # inference guard; run_step's default model
    parts.auto.after_setup(model)  # compiled after the first steps when that pays
    parts.seeding.after_setup()  # seed_per_rank: seed + rank from here on
    if optimizer is None:
        return model
    optimizer = strategy.setup_optimizer(model, optimizer)  # FSDP: the sharded params
    if optimizer.state:
        # the optimizer's own loader casts state to each parameter's device and dtype
        # (and keeps Adam's "step" counters where they belong)
        optimizer.load_state_dict(optimizer.state_dict())
    return model, optimizer


def set_up_loader(parts: SessionParts, seed: int | None, data: Any, batch_size: int | None, shuffle: bool | None,
                  num_workers: int | str | None, even_batches: str | bool, **kwargs: Any) -> DeviceLoader:
    """``session.setup_dataloader(...)`` (documented there) in a launched session.

    Args:
        parts: the session's parts (its strategy, timings, loader tracker, micro-batch size).
        seed: ``Session(seed=...)``; ``None``: a fresh seed, rank 0's on every rank, recorded in the
            loader's ``state_dict``.
    """
    strategy = parts.strategy
    if seed is None:  # random order per run, recorded in the loader's state_dict
        seed = strategy.broadcast(fresh_seed()) if strategy.world_size > 1 else fresh_seed()
    if batch_size is None and parts.micro_batch_size is not None and not hasattr(data, "batch_sampler"):
        batch_size = parts.micro_batch_size
    place = LoaderPlace(strategy.root_device, strategy.accelerator, rank=strategy.data_parallel_rank,
                        world_size=strategy.data_parallel_size, local_world_size=strategy.num_processes,
                        seed=int(seed), broadcast=strategy.broadcast, timings=parts.timings, listener=parts.loaders)
    request = LoaderRequest.of(batch_size, shuffle, num_workers, even_batches, **kwargs)
    loader = build_loader(data, place, request)
    parts.loaders.made += 1
    note = loader.shard_note()  # padding or dropping: said once, on rank 0
    if note and parts.timings.report and strategy.rank == 0:
        print(f"gpukit: {note}", flush=True)
    return loader


def _regroup(parts: SessionParts, degree: int) -> None:
    """Apply the tensor-parallel degree ``Session(tensor_parallel="auto", fit=...)`` chose: the strategy's
    layout, then the data-parallel coordinates the loader tracker and the seeding hold.

    Raises:
        ConfigurationError: a loader was set up before the model, sharded for the coordinates of then.
    """
    strategy = parts.strategy
    if parts.loaders.made:
        raise ConfigurationError(
            f"Session(tensor_parallel='auto', fit=...) chose tensor_parallel={degree} at setup, but "
            f"{parts.loaders.made} loader(s) were set up before it, sharded over {strategy.data_parallel_size} "
            "data-parallel ranks: call session.setup(model, ..., example_input=...) before "
            "session.setup_dataloader(...), or give the degree (Session(tensor_parallel=N)).")
    strategy.choose_degree(degree)  # type: ignore[attr-defined]  # only a TensorParallelStrategy is "auto"
    parts.loaders.world_size = strategy.data_parallel_size
    parts.seeding.regroup(strategy.data_parallel_rank, strategy.data_parallel_size)
