"""``split``: place consecutive layers of a model on several devices, in one process."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpukit._util.units import format_bytes
from gpukit._util.warnings import warn_at_user_code
from gpukit.errors import ConfigurationError
from gpukit.parallel._balance import LayerCost, check_balance, layer_costs, partition
from gpukit.parallel._batchnorm import has_training_batchnorm
from gpukit.parallel._forward_check import check_chain_matches_forward
from gpukit.parallel._layers import resolve_layers
from gpukit.parallel._pipeline import SplitModel, Stage
from gpukit.placement import resolve_device

__all__ = ["split", "check_chunks", "resolve_stage_devices"]


def resolve_stage_devices(devices: Any) -> list[torch.device]:
    """The stage devices, each checked by :func:`gpukit.resolve_device` ("cpu" may repeat).

    Raises:
        ConfigurationError: not a non-empty list of device specs.
        DeviceError: a device that is not available in this process.
    """
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ConfigurationError(
            f"split(devices={devices!r}) needs a list with one device per stage, e.g. "
            'devices=["cuda:0", "cuda:1"] (or [0, 1]; ["cpu", "cpu"] runs the stages on the CPU).'
        )
    return [resolve_device(d) for d in devices]


def check_chunks(chunks: Any) -> int:
    """``chunks`` if it is an int >= 1.

    Raises:
        ConfigurationError: anything else.
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigurationError(
            f"split(chunks={chunks!r}): use an int >= 1 (1: no micro-batches; GPipe suggests "
            "about 4x the number of stages)."
        )
    return chunks


def split(
    model: nn.Module,
    devices: Sequence[str | int | torch.device],
    balance: Sequence[int] | None = None,
    chunks: int = 1,
    *,
    layers: Sequence[str | nn.Module] | None = None,
    example_input: Any = None,
    optimizer: Any = "adam",
    precision: str = "32-true",
    deferred_batchnorm: bool = False,
    verbose: bool = True,
) -> SplitModel:
    """Put consecutive layers of ``model`` on ``devices`` (one stage per device) and run them
    as a pipeline over ``chunks`` micro-batches.

    Activations move to the next stage's device and their gradients back (autograd follows
    the moves). The input may be on any device; the output is on the last device. With
    ``chunks=K > 1`` the batch is cut into K micro-batches along dim 0 and run GPipe-style
    (stage s on micro-batch m while stage s-1 is on m+1); loss, gradients and optimizer step
    equal the unsplit model's up to float rounding, except where layers see micro-batches
    rather than the batch: BatchNorm in training mode (see ``deferred_batchnorm``) and
    random layers (dropout draws other masks).

    Args:
        model: an ``nn.Sequential``, or any model whose ``layers`` are named. Moved in place.
        devices: one device per stage: ``["cuda:0", "cuda:1"]``, ``[0, 1]``, or ``"cpu"``
            repeated (runs on the CPU; how it is tested without GPUs).
        balance: layers per stage (``[3, 5]``), summing to the number of layers. ``None``:
            balanced by the memory planner (see ``example_input``).
        chunks: micro-batches per forward (>= 1, at most the batch size).
        layers: for a model that is not an ``nn.Sequential``: its sub-modules in the order they
            run (names, dotted paths or modules; a ModuleList counts as its children). The split
            model computes ``layers[-1](...layers[0](x))`` instead of ``model.forward``: with
            ``example_input`` the two are compared once (an error when they differ, e.g. a
            forward with residual connections); without it a warning says so once.
        example_input: an input batch (only shapes and dtypes are used) so that ``balance=None``
            weighs each layer by the planner's parameters + gradients + optimizer state +
            activations; without it layers are weighed by parameter bytes only.
        optimizer, precision: what the memory planner plans for (see ``estimate_memory``).
        deferred_batchnorm: with ``chunks > 1``, set BatchNorm running statistics from the
            whole batch instead of updating them once per micro-batch.
        verbose: print the placement (stage, device, layers, parameters, planned memory) on
            rank 0 (the process whose ``RANK`` is 0 or unset).

    Returns:
        A :class:`SplitModel` (an ``nn.Module``) whose ``state_dict`` has the plain model's keys.

    Raises:
        ConfigurationError: more stages than layers, a ``balance`` of the wrong length or sum,
            ``chunks`` not an int >= 1, unknown or overlapping ``layers``.
        DeviceError: a device that is not available here.
        MemoryPlanError: the planner cannot run a layer on fake tensors (pass ``balance``).
    """
    check_chunks(chunks)
    stage_devices = resolve_stage_devices(devices)
    names, modules = resolve_layers(model, layers)
    if layers is not None:
        check_chain_matches_forward(model, modules, example_input)
    if len(stage_devices) > len(modules):
        raise ConfigurationError(
            f"split() got {len(stage_devices)} devices, so {len(stage_devices)} stages, but "
            f"{type(model).__name__} has only {len(modules)} layer(s) ({', '.join(names)}); each "
            f"stage needs at least one layer. Use at most {len(modules)} devices"
            + (", or name finer layers (e.g. the blocks of a ModuleList)." if layers is not None else ".")
        )
    if balance is not None:
        counts = check_balance(balance, len(stage_devices), len(modules))
    costs = layer_costs(modules, example_input, optimizer=optimizer, precision=precision, device=stage_devices[0])
    if balance is None:
        counts = partition([c.weight for c in costs], len(stage_devices))
    stages: list[Stage] = []
    first = 0
    for index, (device, count) in enumerate(zip(stage_devices, counts)):
        stages.append(Stage(index, device, first, names[first : first + count], modules[first : first + count]))
        first += count
    _check_no_shared_parameters(stages)
    for stage in stages:
        for module in stage.modules:
            module.to(stage.device)
    if chunks > 1 and not deferred_batchnorm and has_training_batchnorm(modules):
        warn_at_user_code(UserWarning(
            f"split(chunks={chunks}): the model has BatchNorm layers in training mode; each "
            "micro-batch is normalised with its own statistics and the running statistics are "
            f"updated {chunks} times per batch. Pass deferred_batchnorm=True to keep whole-batch "
            "running statistics, or chunks=1 for the unsplit model's exact behaviour."
        ))
    split_model = SplitModel(model, stages, chunks, deferred_batchnorm)
    if verbose and os.environ.get("RANK", "0") == "0":
        print(placement_table(split_model, costs, balance is None, example_input is not None), file=sys.stderr)
    return split_model


def _check_no_shared_parameters(stages: list[Stage]) -> None:
    """A parameter tied between layers (e.g. embedding and output weights) cannot live on two
    devices: refuse a cut between its users before anything moves."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in stages:
        for layer_name, module in zip(stage.names, stage.modules):
            for name, param in module.named_parameters(remove_duplicate=False):
                key = f"{layer_name}.{name}" if layer_name else name
                first_stage, first_key = owner.setdefault(id(param), (stage.index, key))
                if first_stage != stage.index:
                    raise ConfigurationError(
                        f"split(): {first_key!r} (stage {first_stage}) and {key!r} (stage "
                        f"{stage.index}) are the same tied parameter, which cannot sit on two "
                        "devices. Choose a balance that keeps the layers sharing it in one stage, "
                        "or untie the weights."
                    )


def placement_table(model: SplitModel, costs: list[LayerCost], balanced: bool, planned: bool) -> str:
    """The placement, one line per stage: device, layers, parameter bytes, planned memory."""
    how = "given balance" if not balanced else (
        "balanced by planned memory (parameters, gradients, optimizer state, activations)" if planned
        else "balanced by parameter bytes (activations not counted: pass example_input= to plan them)"
    )
    lines = [f"gpukit: split into {len(model.stages)} stages, chunks={model.chunks}, {how}"]
    lines.append(f"  {'stage':<6}{'device':<10}{'layers':<28}{'parameters':>12}{'planned memory':>16}")
    for stage in model.stages:
        mine = costs[stage.first : stage.first + len(stage.names)]
        shown = stage.names[0] if len(stage.names) == 1 else f"{stage.names[0]} .. {stage.names[-1]}"
        params = sum(c.parameters_bytes for c in mine)
        plan = format_bytes(sum(c.planned_bytes or 0 for c in mine)) if planned else "-"
        lines.append(
            f"  {stage.index:<6}{str(stage.device):<10}{f'{shown} ({len(stage.names)})':<28}"
            f"{format_bytes(params):>12}{plan:>16}"
        )
    return "\n".join(lines)
