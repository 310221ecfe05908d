"""Strategies: how a model is placed, wrapped and kept in sync across devices.

- ``"single"``: one device in one process.
- ``"dp"``: :class:`torch.nn.DataParallel` over several GPUs in one process.
- ``"ddp"``: :class:`~torch.nn.parallel.DistributedDataParallel`, one process per device.
- ``"pipeline"``: the model's layers split over several devices in one process
  (:func:`gpukit.parallel.split`).
- ``"fsdp"``: FSDP2 ``fully_shard``, parameters/gradients/optimizer state sharded over processes.
- ``"tp"`` / ``tensor_parallel=N``: each layer split over groups of N processes (DTensor), the groups
  replicated ("ddp") or sharded ("fsdp") on a 2-D ``("dp", "tp")`` mesh (:mod:`gpukit.strategies.tensor`).
- ``activation_checkpointing=`` (any strategy): blocks recompute their activations in backward.
- ``"auto"``: ddp when several processes are launched or asked for, else single.

The names are registered in :mod:`gpukit.layout` (the one registry); each strategy's ``layout``
says how it divides the work and gives its data-parallel rank and size.
"""

from __future__ import annotations

from gpukit.strategies._checkpointing import apply_activation_checkpointing, configure_strategy
from gpukit.strategies._compile import CompileRequest, check_compile, compile_module, compile_request
from gpukit.strategies._env import DistEnv
from gpukit.strategies._select import ACCELERATORS, STRATEGIES, select_strategy
from gpukit.strategies._syncbn import HostSyncBatchNorm, convert_sync_batchnorm
from gpukit.strategies.base import REDUCE_OPS, Strategy
from gpukit.strategies.ddp import DDPStrategy
from gpukit.strategies.dp import DataParallelStrategy, ModelWithLoss
from gpukit.strategies.fsdp import FSDPStrategy
from gpukit.strategies.pipeline import PipelineStrategy
from gpukit.strategies.single import SingleDeviceStrategy
from gpukit.strategies.tensor import TensorParallelStrategy

__all__ = [
    "ACCELERATORS",
    "CompileRequest",
    "DDPStrategy",
    "DataParallelStrategy",
    "DistEnv",
    "FSDPStrategy",
    "HostSyncBatchNorm",
    "ModelWithLoss",
    "PipelineStrategy",
    "REDUCE_OPS",
    "STRATEGIES",
    "apply_activation_checkpointing",
    "check_compile",
    "compile_module",
    "compile_request",
    "configure_strategy",
    "SingleDeviceStrategy",
    "Strategy",
    "TensorParallelStrategy",
    "convert_sync_batchnorm",
    "select_strategy",
]
