"""The Strategy base class: how a model is placed, wrapped and kept in sync.

Base methods do the single-process thing (collectives are the identity), so each strategy
overrides only what differs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from gpukit.accelerators import Accelerator
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.precision import Precision

__all__ = ["Strategy", "REDUCE_OPS"]

REDUCE_OPS = ("mean", "sum", "max", "min")


class Strategy:
    """One process, one device. Subclasses add wrapping and communication."""

    name: str = "single"
    #: parameters stay plain tensors (False: DTensor shards or pieces, whatever the degree)
    plain_parameters: bool = True
    #: runs 16-mixed's GradScaler (False: refuses it, and precision="auto" is never 16-mixed here)
    loss_scaling: bool = True

    def __init__(self, accelerator: Accelerator, device: torch.device) -> None:
        self.accelerator = accelerator
        self.root_device = device
        #: the run's precision, owned here (as Fabric's strategy owns it): the Session sets it and every
        #: component reads it here -- the steps scale and step with it, run_step autocasts with it,
        #: checkpoints save its state, DataParallel and FSDP wrap with its dtypes
        self.precision: Precision = Precision(device)
        #: which blocks recompute their activations in backward (see ``_checkpointing``);
        #: ``Session(activation_checkpointing=...)`` sets it, ``setup_module`` applies it
        self.activation_checkpointing: Any = None
        #: qualified names of the checkpointed blocks, after ``setup_module``
        self.checkpointed: list[str] = []
        #: print what set-up chose (the session sets it on rank 0 when verbose)
        self.announce = False

    # -- where this process sits ---------------------------------------------------------
    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def num_processes(self) -> int:
        """How many processes this strategy runs in (on this node)."""
        return 1

    @property
    def launched(self) -> bool:
        """Whether the processes this strategy needs are running (False: call launch)."""
        return True

    @property
    def layout(self) -> Layout:
        """How this job's devices divide the work (replicas x shards x tensor x stages)."""
        return Layout()

    @property
    def data_parallel_rank(self) -> int:
        """Which shard of the data this process loads (the ranks of one tensor group share it)."""
        return self.layout.data_parallel_rank(self.rank)

    @property
    def data_parallel_size(self) -> int:
        """How many processes load different batches: sampler shards, the global batch's divisor."""
        return self.layout.data_parallel_size

    # -- set-up ----------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Make the device current and join any process group (no-op here)."""
        self.accelerator.set_device(self.root_device)

    def materialise_meta(self, module: nn.Module) -> nn.Module:
        """Allocate and initialise a model built on the meta device on this strategy's device
        (:mod:`gpukit.strategies._meta`); any other model is returned as it is."""
        from gpukit.strategies._meta import has_meta_tensors, materialise

        if has_meta_tensors(module):
            materialise(module, self.meta_device, rank=self.rank)
        return module

    @property
    def meta_device(self) -> torch.device:
        """Where ``materialise_meta`` allocates a meta-device model."""
        return self.root_device

    def prepare_module(self, module: nn.Module) -> nn.Module:
        """Change layers before the precision converts them (e.g. SyncBatchNorm). Here: take off a
        DataParallel / DDP wrapper the user put on (as the other strategies do): kept, a DataParallel ran
        over every visible GPU whatever ``devices`` said, its replica threads autocast in torch's default
        fp16 under "bf16-mixed", and ``model.module`` ran outside the session's autocast."""
        while isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            module = module.module
        return module

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move ``module`` to the device and wrap it as the strategy needs."""
        return self.checkpoint_activations(module).to(self.root_device)

    def checkpoint_activations(self, module: nn.Module) -> nn.Module:
        """Apply ``self.activation_checkpointing`` to the plain ``module`` (before any wrapping)."""
        from gpukit.strategies._checkpointing import apply_activation_checkpointing

        self.checkpointed = apply_activation_checkpointing(module, self.activation_checkpointing)
        return module

    def _describe_checkpointing(self) -> str:
        return f", activation checkpointing on {len(self.checkpointed)} block(s)" if self.checkpointed else ""

    def run_at_precision(self, module: nn.Module) -> nn.Module:
        """Make the set-up ``module`` compute at the precision by itself: under a "-mixed" precision
        its forward runs under autocast (``Precision.wrap_forward``), so a loop without
        ``session.autocast()`` is mixed too. In place; returns ``module``."""
        self.precision.wrap_forward(self.precision_target(module))
        return module

    def precision_target(self, module: nn.Module) -> nn.Module:
        """The module whose forward ``run_at_precision`` wraps: the set-up module itself here (the
        DataParallel wrapper, whose replica threads then autocast too; the split model; the FSDP root)."""
        return module

    def compile_targets(self, module: nn.Module) -> list[nn.Module]:
        """The parts of the set-up ``module`` to compile in place (see ``_compile.py``): all of it here."""
        return [module]

    def setup_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Fit ``optimizer`` to the set-up ``module`` (FSDP swaps in sharded parameters); no-op here."""
        return optimizer

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters to total 2-norm ``max_norm``.

        Returns:
            The total norm before clipping.
        """
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def no_backward_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context in which ``backward`` does not synchronise gradients across processes."""
        return contextlib.nullcontext()

    def teardown(self) -> None:
        """Leave any process group this strategy created."""

    # -- collectives (identity in one process) ------------------------------------------------
    def barrier(self) -> None:
        """Wait until every process got here."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from process ``src`` on every process (tensors or picklable objects)."""
        return obj

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Reduce ``value`` over processes with ``op``; returns a new tensor on every process."""
        check_reduce_op(op)
        return self.as_tensor(value)

    def all_gather(self, value: torch.Tensor | float) -> torch.Tensor:
        """Every process's ``value`` stacked along a new first dimension of size world_size."""
        return self.as_tensor(value).unsqueeze(0)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's picklable ``obj``, in rank order."""
        return [obj]

    def as_tensor(self, value: torch.Tensor | float) -> torch.Tensor:
        """``value`` as a tensor (a Python number on this process's device).

        Raises:
            ConfigurationError: anything else.
        """
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (int, float, bool)):
            return torch.tensor(value, device=self.root_device)
        raise ConfigurationError(
            f"Collectives take a tensor or a Python number, got {type(value).__name__}; "
            "convert it with torch.as_tensor (or use broadcast, or session.gather_for_metrics, for other objects)."
        )

    def describe(self) -> str:
        """One line for the user: what runs where."""
        return f"{self.name} on {self.root_device}{self._describe_checkpointing()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


def check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ConfigurationError(
            f"Unknown reduce op {op!r}; choose one of {', '.join(map(repr, REDUCE_OPS))}."
        )
