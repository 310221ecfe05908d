"""Tensor parallelism through torch's DTensor, alone or on a 2-D ``("dp", "tp")`` mesh.

``Session(tensor_parallel=2)`` splits each layer of the model over groups of 2 processes that see the
*same* batch (``parallelize_module`` with column-/row-wise styles, the plan found by structure in
:mod:`gpukit.strategies._tp_plan`, or the user's ``tensor_plan=``). With more processes than the degree,
the groups are data parallel over the mesh's ``"dp"`` dimension: ``strategy="ddp"`` (the default)
replicates each tensor group's shards and all-reduces gradients over ``"dp"`` only (FSDP2's
``replicate(mesh=mesh["dp"])``: torch's ``DistributedDataParallel(device_mesh=...)`` keeps DTensor
parameters only by swapping them for local tensors around each forward, which leaves
``module.parameters()`` empty), ``strategy="fsdp"`` shards them further with FSDP2
``fully_shard(mesh=mesh["dp"])`` after ``parallelize_module(mesh["tp"])`` (torchtitan's order).

Ranks are laid out as :class:`~gpukit.layout.Layout` orders them, tensor innermost: ranks ``0..t-1`` are
the first tensor group. Gradients are never averaged across a tensor group: its ranks hold different
shards (split layers) or the same gradient (layers left whole).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch
from torch import nn

from gpukit._util.warnings import user_stacklevel
from gpukit.accelerators import Accelerator
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.placement import unwrap_model
from gpukit.strategies._env import DistEnv
from gpukit.strategies._tp_plan import TensorPlan, auto_plan, check_plan
from gpukit.strategies.base import Strategy
from gpukit.strategies.ddp import DDPStrategy
from gpukit.strategies.fsdp import FSDPStrategy

__all__ = ["TensorParallelStrategy", "with_tensor_parallel", "check_degree", "REPLICATE_MIN_TORCH"]

#: FSDP2's ``replicate`` on a 1-D mesh (the "dp" dimension of a replicated job): torch 2.9's took a 2-D
#: (replicate, shard) mesh only, and torch 2.5-2.8 have no ``torch.distributed._composable.replicate_with_fsdp``
REPLICATE_MIN_TORCH = (2, 10)


def check_degree(degree: Any, world_size: int | None = None) -> int:
    """``tensor_parallel=`` as a whole number >= 1 that divides the world size (when known).

    Raises:
        ConfigurationError: anything else.
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ConfigurationError(f"tensor_parallel={degree!r}: give a whole number >= 1 (1: layers are not split).")
    if world_size is not None and world_size % degree:
        raise ConfigurationError(
            f"tensor_parallel={degree} does not divide the {world_size} processes: the job is "
            f"(data-parallel groups) x {degree}. Launch a multiple of {degree} processes, or change the degree."
        )
    return degree


def _replicate_api(degree: int, groups: int) -> Any:
    """FSDP2's ``replicate`` (DDP over the mesh's "dp" dimension for DTensor parameters).

    Raises:
        ConfigurationError: the installed torch has none that takes a 1-D mesh (before anything is split).
    """
    from gpukit.strategies._fsdp_api import _torch_version

    if _torch_version() >= REPLICATE_MIN_TORCH:
        try:
            from torch.distributed._composable.replicate_with_fsdp import replicate
        except ImportError:
            pass
        else:
            return replicate
    need = ".".join(map(str, REPLICATE_MIN_TORCH))
    given = f"tensor_parallel={degree}" if degree > 1 else "tensor_parallel='auto'"  # degree 1: chosen later
    raise ConfigurationError(
        f"{given} with strategy='ddp' replicates the {groups} data-parallel groups with FSDP2's "
        f"replicate on a 1-D mesh (torch.distributed._composable.replicate_with_fsdp), which needs torch >= {need}; "
        f"this is torch {torch.__version__}. Use strategy='fsdp' (the groups sharded instead), one tensor group "
        f"(as many processes as the degree), or upgrade torch (pip install 'torch>={need}')."
    )


def _warn_across_nodes(degree: int, env: DistEnv | None, rank: int) -> None:
    """Warn (once, on rank 0) when tensor groups of ``degree`` span nodes: ranks are tensor-innermost, so a
    group stays inside a node only when the degree divides the processes per node."""
    if env is None or rank != 0 or degree < 2 or env.world_size <= env.local_world_size:
        return
    if env.local_world_size % degree == 0:
        return
    fits = [t for t in range(2, env.local_world_size + 1)
            if env.local_world_size % t == 0 and env.world_size % t == 0]
    hint = (f"a degree that divides them ({', '.join(map(str, fits))})" if fits
            else "more processes per node, or data parallelism alone (no tensor_parallel)")
    warnings.warn(
        f"tensor_parallel={degree} puts tensor groups across nodes: the job runs {env.local_world_size} "
        f"process(es) per node, so some groups of {degree} consecutive ranks span two nodes and every split layer's "
        "collectives (each forward and backward) cross the network between them, which is typically many times "
        f"slower than the link inside a node. Use {hint}; the data-parallel groups are what should cross nodes.",
        RuntimeWarning, stacklevel=user_stacklevel())


class _TensorParallel:
    """The tensor half of the strategy: the degree, the ``("dp", "tp")`` mesh, the checked plan, splitting."""

    def __init__(self, degree: int, plan: dict[str, Any] | None) -> None:
        self.degree = degree
        self.user_plan = plan
        self.plan: TensorPlan | None = None
        self.mesh: Any = None

    def device_mesh(self, device_type: str, world_size: int) -> Any:
        """The ``("dp", "tp")`` mesh (built once, after the process group exists)."""
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            check_degree(self.degree, world_size)
            self.mesh = init_device_mesh(device_type, (world_size // self.degree, self.degree),
                                         mesh_dim_names=("dp", "tp"))
        return self.mesh

    def split(self, module: nn.Module, device_type: str, world_size: int) -> nn.Module:
        """Check the plan on the whole model, then split it over the mesh's ``"tp"`` dimension.

        Raises:
            ConfigurationError: a layer that cannot be split (before anything is sharded).
        """
        from torch.distributed.tensor.parallel import parallelize_module

        plan = (check_plan(module, self.user_plan, self.degree) if self.user_plan is not None
                else auto_plan(module, self.degree))
        mesh = self.device_mesh(device_type, world_size)
        parallelize_module(module, mesh["tp"], plan.styles)
        for prefix, attr, value in plan.heads:  # attention reshapes by its local head count
            setattr(module.get_submodule(prefix), attr, value)
        self.plan = plan
        return module

    def choose(self, degree: int, world_size: int) -> None:
        """Set the degree ``Session(tensor_parallel="auto", fit=...)`` chose, before the mesh exists.

        Raises:
            ConfigurationError: the mesh was built already (a model was split), or a degree that does not
                divide ``world_size``.
        """
        if self.mesh is not None and degree != self.degree:
            raise ConfigurationError(
                f"tensor_parallel={degree} was chosen after the ({world_size // self.degree} x {self.degree}) mesh "
                "was built for an earlier model: set up the model Session(fit=...) plans first.")
        self.degree = check_degree(degree, world_size)

    def describe(self) -> str:
        return f"tensor x{self.degree} ({self.plan.describe() if self.plan else 'layers split at setup'})"


def _same_start(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, before the split (as DDP does at construction).

    Without it a model initialised differently on each rank (a script without ``Session(seed=...)``) trains
    wrong, silently: a layer left whole differs across its tensor group, whose ranks then compute different
    activations where the split layers assume the same ones, and replicated groups (FSDP2's ``replicate``,
    unlike torch's DDP, broadcasts nothing) start, and stay, different models.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_contiguous():
                dist.broadcast(tensor.detach(), 0)
            else:
                dense = tensor.detach().contiguous()
                dist.broadcast(dense, 0)
                tensor.detach().copy_(dense)


def _replication(tensor: torch.Tensor, world_size: int) -> int:
    """On how many ranks of the job ``tensor``'s local values are the same ones (1: each rank its own)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return world_size
    mesh = tensor.device_mesh
    copies = math.prod(mesh.size(i) for i, p in enumerate(tensor.placements) if p.is_replicate())
    return copies * (world_size // mesh.size())


def _settled(grad: Any) -> Any:
    """``grad`` with pending (partial) sums reduced: a partial shard's norm is not a part of the total's."""
    from torch.distributed.tensor import Replicate

    if not any(p.is_partial() for p in grad.placements):
        return grad
    return grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


class TensorParallelStrategy(FSDPStrategy):
    """Layers split over tensor groups of ``degree`` processes; several groups are data parallel over
    the mesh's ``"dp"`` dimension: replicated (``sharded=False``, DDP-like: FSDP2's ``replicate``) or
    sharded (``sharded=True``: FSDP2 ``fully_shard``).

    ``Session(tensor_parallel=2)`` builds it (``strategy="ddp"``: replicated, ``"fsdp"`` or an
    ``FSDPStrategy(...)`` object: sharded, with that object's settings).

    Args:
        accelerator, device, env, num_processes: filled in by the session.
        degree: processes per tensor group (``tensor_parallel=``).
        plan: module name -> ``ParallelStyle`` (``tensor_plan=``); ``None``: found by structure.
        sharded: shard over the data-parallel groups (FSDP) instead of replicating.
        **fsdp: :class:`FSDPStrategy` settings (``auto_wrap``, ``cpu_offload``...; sharded only).

    Raises:
        ConfigurationError: a degree that does not divide the launched processes.
    """

    name = "tp"

    def __init__(self, accelerator: Accelerator | None = None, device: torch.device | None = None,
                 env: DistEnv | None = None, num_processes: int = 1, *, degree: int = 2,
                 plan: dict[str, Any] | None = None, sharded: bool = False, **fsdp: Any) -> None:
        super().__init__(accelerator, device, env, num_processes, **fsdp)
        self.tp = _TensorParallel(check_degree(degree, self.world_size), plan)
        self.sharded = bool(sharded)
        self._meta_names: dict[int, str] = {}
        if not self.sharded and 1 < degree < self.world_size:  # refused now, not at setup
            _replicate_api(degree, self.world_size // degree)
        _warn_across_nodes(degree, env, self.rank)

    @classmethod
    def for_process(cls, accelerator: Accelerator, device: torch.device, env: DistEnv | None, num_processes: int,
                    *, sync_batchnorm: bool = False, shares_gpu: bool = False) -> TensorParallelStrategy:
        """``strategy="tp"``: every process in one tensor group (see :meth:`DDPStrategy.for_process`)."""
        _refuse_shared_gpu(shares_gpu, num_processes)
        return cls(accelerator, device, env, num_processes, degree=env.world_size if env else num_processes)

    @property
    def layout(self) -> Layout:
        groups = self.world_size // self.tp.degree
        if self.sharded:
            return Layout(shards=groups, tensor=self.tp.degree, offload=self.cpu_offload)
        return Layout(replicas=groups, tensor=self.tp.degree)

    def _data_parallel_mesh(self) -> Any:
        return self.tp.device_mesh(self.root_device.type, self.world_size)["dp"]

    def materialise_meta(self, module: nn.Module) -> nn.Module:
        """A meta-device model is allocated whole first and split afterwards."""
        # the optimizer was built from the meta parameters, which allocating replaces
        self._meta_names = {id(p): n for n, p in unwrap_model(module).named_parameters()}
        return Strategy.materialise_meta(self, module)

    def setup_module(self, module: nn.Module) -> nn.Module:
        replicate = (_replicate_api(self.tp.degree, self.layout.data_parallel_size)  # before anything is split
                     if not self.sharded and self.layout.data_parallel_size > 1 else None)
        module = unwrap_model(module).to(self.root_device)
        _same_start(module)
        names = {**{id(p): n for n, p in module.named_parameters()}, **self._meta_names}
        if self.tp.degree > 1:  # degree 1: tensor_parallel="auto" chose no groups (data parallel only)
            module = self.tp.split(module, self.root_device.type, self.world_size)
        if self.sharded:
            module = super().setup_module(module)
        else:
            self.checkpoint_activations(module)
            if replicate is not None:
                # DDP over "dp" for DTensor parameters (torch's DDP keeps them only by swapping
                # them for local tensors each forward, which empties module.parameters())
                replicate(module, mesh=self._data_parallel_mesh(),
                          mp_policy=self._root_policies(self._policies())["mp_policy"])
            if self.announce:
                print(f"gpukit: {self.describe()}", file=sys.stderr)
        self._param_names = names  # the optimizer holds the parameters from before the split
        return module

    def choose_degree(self, degree: int) -> None:
        """The tensor-parallel degree ``Session(tensor_parallel="auto", fit=...)`` chose at setup: the
        layout, and so the data-parallel rank and size, follow it (see :meth:`_TensorParallel.choose`)."""
        self.tp.choose(degree, self.world_size)
        _warn_across_nodes(degree, self.env, self.rank)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole gradient: each shard counted once, copies of it not again."""
        from torch.distributed.tensor import DTensor

        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # local shards (torch's foreach clipping refuses DTensor and plain gradients side by side)
        for param in params:
            if isinstance(param.grad, DTensor):
                param.grad = _settled(param.grad)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        total_sq = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for param, grad in zip(params, grads):
            # the gradient's placement, not the parameter's: torch gives a row-wise embedding a replicated gradient
            total_sq += grad.detach().float().pow(2).sum() / _replication(param.grad, self.world_size)
        total = self.all_reduce(total_sq, op="sum").sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's clip_grads_with_norm_ formula
        for grad in grads:
            grad.mul_(scale.to(grad.device, grad.dtype))
        return total

    def describe(self) -> str:
        groups = self.layout.data_parallel_size
        over = f"{'sharded' if self.sharded else 'replicated'} x{groups}, " if groups > 1 else ""
        checkpointing = self._describe_checkpointing()
        return (f"tp rank {self.rank}/{self.world_size} on {self.root_device} with {self.backend}: "
                f"{over}{self.tp.describe()}{checkpointing}")


def _refuse_shared_gpu(shares_gpu: bool, processes: int) -> None:
    if shares_gpu:
        raise ConfigurationError(
            f"tensor_parallel needs a GPU per process, but the {processes} processes on this node share the one "
            f"GPU they see. Give each process a GPU: gpukit run --gpus {processes} ..."
        )


def with_tensor_parallel(strategy: Strategy, degree: int, plan: dict[str, Any] | None, *,
                         chosen_later: bool = False) -> Strategy:
    """``strategy`` (DDP or FSDP, placed for this process) with its layers split over groups of ``degree``.

    ``chosen_later`` (``tensor_parallel="auto"``): degree 1 for now, the data-parallel groups on FSDP2
    (``replicate`` / ``fully_shard`` over the whole job); ``Session(fit=...)`` sets the degree at setup
    (:meth:`TensorParallelStrategy.choose_degree`).

    Raises:
        ConfigurationError: a strategy that cannot be combined with tensor parallelism, or a degree that does
            not divide the processes.
    """
    check_degree(degree)
    if degree == 1 and not chosen_later:
        raise ConfigurationError("tensor_plan= was given with tensor_parallel=1: give the degree too, e.g. "
                                 "Session(tensor_parallel=2, tensor_plan={...}).")
    if isinstance(strategy, TensorParallelStrategy):
        return strategy
    shares_gpu = isinstance(strategy, DDPStrategy) and strategy.backend != strategy.accelerator.distributed_backend
    _refuse_shared_gpu(shares_gpu, strategy.num_processes)
    if type(strategy) is FSDPStrategy:
        return TensorParallelStrategy(
            strategy.accelerator, strategy.root_device, strategy.env, strategy.num_processes, degree=degree,
            plan=plan, sharded=True, auto_wrap=strategy.auto_wrap, min_unit_params=strategy.min_unit_params,
            cpu_offload=strategy.cpu_offload, reshard_after_forward=strategy.reshard_after_forward,
            timeout_s=strategy.timeout_s, activation_checkpointing=strategy.activation_checkpointing,
        )
    if type(strategy) is DDPStrategy:
        if strategy.sync_batchnorm:
            raise ConfigurationError(
                "sync_batchnorm=True with tensor_parallel is not supported (BatchNorm over split activations); "
                "drop one of them."
            )
        return TensorParallelStrategy(strategy.accelerator, strategy.root_device, strategy.env,
                                      strategy.num_processes, degree=degree, plan=plan, timeout_s=strategy.timeout_s)
    raise ConfigurationError(
        f"tensor_parallel={degree} splits layers over processes; strategy {strategy.name!r} cannot carry it. "
        "Use strategy='ddp' (or 'auto': tensor groups replicated) or 'fsdp' (tensor groups sharded), with "
        f"a multiple of {degree} processes."
    )
