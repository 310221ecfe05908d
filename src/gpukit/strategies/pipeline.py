"""Pipeline (model parallel) in one process: the model's layers split across devices.

``setup_module`` calls :func:`gpukit.parallel.split`: consecutive layers go to consecutive
devices, activations move forward and gradients back, and with ``chunks > 1`` micro-batches
keep the stages busy at once. The session's device (where loaders put batches, and where
outputs and targets meet for the loss) is the **last** stage's device; the split model moves
its input to the first stage itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpukit.accelerators import get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.parallel import check_chunks, resolve_stage_devices, split
from gpukit.placement import unwrap_model
from gpukit.strategies._checkpointing import check_policy
from gpukit.strategies.base import Strategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(Strategy):
    """Split the model over ``devices`` in this process (see :func:`gpukit.parallel.split`).

    Args:
        devices: one device per stage (``[0, 1]``, ``["cuda:0", "cuda:1"]``; ``["cpu", "cpu"]``
            for a CPU run), all of one type.
        chunks: micro-batches per forward (1: the plain model-parallel tutorial; ~4x the
            number of stages keeps the devices busy).
        balance, layers, example_input, deferred_batchnorm, verbose: as for ``split``.
        activation_checkpointing: True (every block), "selective", a set of classes or a
            callable (see ``gpukit.strategies._checkpointing``); applied before the split.

    Raises:
        ConfigurationError: devices of different types, or ``chunks`` not an int >= 1.
        DeviceError: a device that is not available here.
    """

    name = "pipeline"

    def __init__(
        self,
        devices: Sequence[str | int | torch.device],
        chunks: int = 1,
        balance: Sequence[int] | None = None,
        *,
        layers: Sequence[str | nn.Module] | None = None,
        example_input: Any = None,
        deferred_batchnorm: bool = False,
        verbose: bool = True,
        activation_checkpointing: Any = None,
    ) -> None:
        check_chunks(chunks)
        stage_devices = resolve_stage_devices(devices)
        types = sorted({d.type for d in stage_devices})
        if len(types) > 1:
            raise ConfigurationError(
                f"strategy='pipeline' got devices of several types ({', '.join(types)}: "
                f"{[str(d) for d in stage_devices]}); one precision and autocast serve all stages, "
                "so use devices of one type."
            )
        super().__init__(get_accelerator(stage_devices[-1]), stage_devices[-1])
        self.devices = stage_devices
        self.chunks = chunks
        self.balance = balance
        self.layers = layers
        self.example_input = example_input
        self.deferred_batchnorm = deferred_batchnorm
        self.verbose = verbose
        self.activation_checkpointing = check_policy(activation_checkpointing)

    @property
    def meta_device(self) -> torch.device:
        """The CPU: a meta-device model is allocated there, then its stages move to their devices."""
        return torch.device("cpu")

    def setup_module(self, module: nn.Module) -> nn.Module:
        return split(
            self.checkpoint_activations(unwrap_model(module)), self.devices, self.balance, self.chunks, layers=self.layers,
            example_input=self.example_input, precision=self.precision.name,
            deferred_batchnorm=self.deferred_batchnorm, verbose=self.verbose,
        )

    def compile_targets(self, module: nn.Module) -> list[nn.Module]:
        raise ConfigurationError(
            "compiling is not supported with strategy='pipeline' (its stages run as separate, hand-driven "
            "pieces); compile single layers yourself (layer.compile()) before session.setup, or use compile=False.")

    @property
    def layout(self) -> Layout:
        return Layout(stages=len(self.devices), one_process=True)

    def describe(self) -> str:
        shown = ", ".join(str(d) for d in self.devices)
        return (f"pipeline over [{shown}], chunks={self.chunks}, outputs on {self.root_device}"
                f"{self._describe_checkpointing()}")
