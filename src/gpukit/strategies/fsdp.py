"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``).

Each process keeps 1/world_size of every parameter, gradient and optimizer state; a unit's
full parameters are all-gathered just before it runs and freed after, and gradients are
reduce-scattered. Which sub-modules are units is the wrapping policy of
``gpukit.memory.units_to_shard`` (transformer blocks, stacks of blocks and large layers by
default; the root last). Works with nccl on GPUs and gloo on CPU processes.

Precision names map onto FSDP's ``MixedPrecisionPolicy``: "bf16-mixed" gathers parameters
in bf16 and reduces gradients in fp32 (sharded weights and optimizer state stay fp32), and the
model's output comes back in fp32 (as a loss under autocast is computed);
"bf16-true"/"16-true" keep the weights in 16 bits (norm layers, kept in fp32, become units of
their own so each unit has one dtype). Under "bf16-mixed" BatchNorm-like layers (running
statistics) are units of their own gathered in fp32, as autocast runs them without FSDP: their
buffers stay fp32, and ``batch_norm`` refuses bf16 weights beside fp32 statistics. "16-mixed"
is refused: its GradScaler would decide "skip this step" per shard.

A model built under ``with torch.device("meta"):`` is sharded first and then allocated and
initialised shard by shard (:mod:`gpukit.strategies._meta`), so no rank ever holds the full
model; the initial values then differ from a CPU-built model's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gpukit._util.dtensor import full_tensor
from gpukit.accelerators import Accelerator
from gpukit.errors import ConfigurationError
from gpukit.layout import Layout
from gpukit.memory import DEFAULT_MIN_UNIT_PARAMS, AutoWrap, units_to_shard
from gpukit.placement import unwrap_model
from gpukit.precision import STATS_NORM_LAYERS, MixedPrecision, fsdp_own_unit_layers
from gpukit.strategies._checkpointing import check_policy
from gpukit.strategies._fsdp_api import check_fsdp_device, fsdp_api
from gpukit.strategies._env import DistEnv
from gpukit.strategies._meta import has_meta_tensors, materialise
from gpukit.strategies.ddp import DDPStrategy

__all__ = ["FSDPStrategy"]


class FSDPStrategy(DDPStrategy):
    """Shard parameters, gradients and optimizer state over the processes with ``fully_shard``.

    ``Session(strategy="fsdp")`` uses the defaults; pass an object for other settings::

        Session(strategy=FSDPStrategy(auto_wrap={MyBlock}, cpu_offload=True))

    Args:
        accelerator, device, env, num_processes: filled in by the session (leave them out).
        auto_wrap: the wrapping policy: ``None`` (default policy, see
            ``gpukit.memory.units_to_shard``), a set of module classes, or a callable
            ``(module, qualified_name) -> bool``.
        min_unit_params: own parameters from which the default policy makes a layer a unit.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory
            (``OffloadPolicy``); the optimizer step then runs on the CPU.
        reshard_after_forward: free gathered parameters after each unit's forward (less
            memory; backward gathers them again). False keeps them until backward.
        timeout_s: collective timeout.
        activation_checkpointing: True (every block), "selective", a set of classes or a
            callable (see ``gpukit.strategies._checkpointing``); applied inside each unit,
            before ``fully_shard``.

    Raises:
        ConfigurationError: a bad ``auto_wrap`` or ``min_unit_params``.
    """

    name = "fsdp"
    plain_parameters = False  # DTensor shards, even over one process
    loss_scaling = False  # a GradScaler would decide per shard whether to skip a step (_policies refuses it)

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        device: torch.device | None = None,
        env: DistEnv | None = None,
        num_processes: int = 1,
        *,
        auto_wrap: AutoWrap = None,
        min_unit_params: int = DEFAULT_MIN_UNIT_PARAMS,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        timeout_s: float | None = None,
        activation_checkpointing: Any = None,
    ) -> None:
        if isinstance(min_unit_params, bool) or not isinstance(min_unit_params, int) or min_unit_params < 1:
            raise ConfigurationError(f"min_unit_params={min_unit_params!r}; use an int >= 1.")
        super().__init__(
            accelerator, device if device is not None else torch.device("cpu"), env,  # type: ignore[arg-type]
            num_processes=num_processes, timeout_s=timeout_s,
        )
        self.auto_wrap = auto_wrap
        self.min_unit_params = min_unit_params
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.activation_checkpointing = check_policy(activation_checkpointing)
        self.units: list[str] | None = None  # qualified names of the units, after setup_module
        self._param_names: dict[int, str] = {}

    @property
    def bound(self) -> bool:
        """Whether the session has filled in the accelerator and device yet."""
        return self.accelerator is not None

    @classmethod
    def for_process(cls, accelerator: Accelerator, device: torch.device, env: DistEnv | None, num_processes: int,
                    *, sync_batchnorm: bool = False, shares_gpu: bool = False) -> FSDPStrategy:
        """This process's FSDP strategy with default settings (see :meth:`DDPStrategy.for_process`).

        Raises:
            ConfigurationError: the node's processes share one GPU (FSDP needs a GPU per process).
        """
        return cls().place(accelerator, device, env, num_processes, shares_gpu=shares_gpu)

    def place(self, accelerator: Accelerator, device: torch.device, env: DistEnv | None, num_processes: int,
              *, shares_gpu: bool = False) -> FSDPStrategy:
        """:meth:`bind` after refusing processes that share one GPU."""
        if shares_gpu:
            raise ConfigurationError(
                f"strategy='fsdp' needs a GPU per process, but the {num_processes} processes on this "
                "node share the one GPU they see. Use strategy='ddp' (it runs over gloo then), or give each "
                f"process a GPU: gpukit run --gpus {num_processes} ..."
            )
        return self.bind(accelerator, device, env, num_processes)

    def bind(
        self, accelerator: Accelerator, device: torch.device, env: DistEnv | None, num_processes: int
    ) -> FSDPStrategy:
        """A copy of this strategy's settings for this process (used by the session)."""
        return FSDPStrategy(
            accelerator, device, env, num_processes, auto_wrap=self.auto_wrap,
            min_unit_params=self.min_unit_params, cpu_offload=self.cpu_offload,
            reshard_after_forward=self.reshard_after_forward, timeout_s=self.timeout_s,
            activation_checkpointing=self.activation_checkpointing,
        )

    def _policies(self) -> dict[str, Any]:
        api = fsdp_api()
        precision = self.precision
        if isinstance(precision, MixedPrecision):
            if precision.scaler is not None:
                raise ConfigurationError(
                    "precision='16-mixed' is not supported with strategy='fsdp': its GradScaler "
                    "would decide per shard whether to skip a step. Use 'bf16-mixed' (no loss "
                    "scaling needed), '32-true', or strategy='ddp' for fp16 mixed precision."
                )
            mp = api.MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
        else:
            mp = api.MixedPrecisionPolicy()  # fp32, or weights already converted ("-true")
        check_fsdp_device(self.root_device.type)  # after the precision: a wrong setting is wrong on any torch
        offload = (api.CPUOffloadPolicy(pin_memory=not self.accelerator.is_host) if self.cpu_offload
                   else api.OffloadPolicy())
        return {"mp_policy": mp, "offload_policy": offload, "reshard_after_forward": self.reshard_after_forward}

    def _root_policies(self, policies: dict[str, Any]) -> dict[str, Any]:
        """The root unit's policies: under a "-mixed" precision the model's output comes back in fp32.

        Without it FSDP returns the last unit's bf16 output, and a loss taken outside
        ``session.autocast()`` against an fp32 target (``mse_loss(model(x), y)``) failed in
        backward with torch's "Found dtype Float but expected BFloat16" (seen on an H100 under
        nccl; DDP computes such a step in fp32 and raises nothing). Autocast computes losses in
        fp32 too, so the output in fp32 is what mixed precision means everywhere else.
        """
        mp = policies["mp_policy"]
        if not isinstance(self.precision, MixedPrecision):
            return policies
        root = fsdp_api().MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                                    output_dtype=torch.float32, cast_forward_inputs=mp.cast_forward_inputs)
        return {**policies, "mp_policy": root}

    def _data_parallel_mesh(self) -> Any:
        """The mesh ``fully_shard`` shards over: every process (a 2-D job's ``"dp"`` dimension: ``tensor.py``)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, (self.world_size,))

    def setup_module(self, module: nn.Module) -> nn.Module:
        api = fsdp_api()

        policies = self._policies()  # refuses what cannot work before anything moves
        module = unwrap_model(module)
        # a model built under torch.device("meta") is materialised shard by shard below: no
        # rank ever holds the whole model (what a model too big for one device needs)
        on_meta = has_meta_tensors(module)
        if not on_meta:
            module = module.to(self.root_device)
        self._param_names = {id(p): n for n, p in module.named_parameters()}
        mesh = self._data_parallel_mesh()
        always = fsdp_own_unit_layers(self.precision.name)  # one dtype per unit
        units = units_to_shard(module, self.auto_wrap, self.min_unit_params, always=always)
        self.checkpoint_activations(module)  # inside each unit: its hooks gather before the recompute
        fp32 = {**policies, "mp_policy": api.MixedPrecisionPolicy(reduce_dtype=torch.float32)}
        for _name, unit in units:
            stats = isinstance(self.precision, MixedPrecision) and isinstance(unit, STATS_NORM_LAYERS)
            api.fully_shard(unit, mesh=mesh, **(fp32 if stats else policies))
        api.fully_shard(module, mesh=mesh, **self._root_policies(policies))
        self.units = [name for name, _ in units]
        if self.announce:  # the session's banner came before the units were chosen
            print(f"gpukit: {self.describe()}", file=sys.stderr)
        if on_meta:
            materialise(module, torch.device("cpu") if self.cpu_offload else self.root_device, rank=self.rank)
        return module

    def materialise_meta(self, module: nn.Module) -> nn.Module:
        """Nothing yet: ``setup_module`` allocates a meta-device model shard by shard, after sharding."""
        return module

    def compile_targets(self, module: nn.Module) -> list[nn.Module]:
        """Each unit after ``fully_shard`` (its gather/free hooks stay outside the graphs); the root if alone."""
        return [module.get_submodule(name) for name in self.units or ()] or [module]

    def setup_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point ``optimizer`` at the sharded parameters that replaced the ones it was built with."""
        if optimizer.state:
            raise ConfigurationError(
                "The optimizer given to session.setup already holds state (it stepped or was "
                "loaded); under strategy='fsdp' that state would not match the shards. Build the "
                "optimizer fresh, call session.setup, then restore with session.resume(...)."
            )
        sharded = dict(module.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[self._param_names[id(p)]] for p in group["params"]]
        return optimizer

    def no_backward_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _accumulating(module)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (global) gradient, not of this rank's shard."""
        from torch.distributed.tensor import DTensor

        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not hasattr(torch.nn.utils, "get_total_norm"):  # torch 2.5: one call, which takes DTensor gradients
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
            return full_tensor(total, back=False) if isinstance(total, DTensor) else total
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            # the per-shard partial norms, reduced over the ranks -- on the mesh's device: with CPU offload the
            # gradients (and so this norm) are on the CPU, and NCCL cannot reduce a CPU tensor
            total = full_tensor(total, back=False)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    @property
    def layout(self) -> Layout:
        return Layout(shards=self.world_size, offload=self.cpu_offload)

    def describe(self) -> str:
        offload = ", CPU offload" if self.cpu_offload else ""
        # units are chosen when the model is set up; the session's banner comes before that
        units = f"{len(self.units) + 1} unit(s)" if self.units is not None else "units chosen at setup"
        return (
            f"fsdp rank {self.rank}/{self.world_size} on {self.root_device} with "
            f"{self.backend}, {units}{offload}{self._describe_checkpointing()}"
        )


@contextlib.contextmanager
def _accumulating(module: nn.Module) -> Iterator[None]:
    """Backward accumulates unsharded local gradients: no reduce-scatter, no resharding."""
    if not isinstance(module, fsdp_api().FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
