"""DistributedDataParallel: one process per device, gradients all-reduced during backward.

The process group comes from the launch environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), which torchrun, ``gpukit run`` and ``session.launch`` set, and
which an ``srun`` task gets from SLURM (see ``gpukit.cluster``). The
backend is the accelerator's (nccl on NVIDIA GPUs, gloo on the CPU). A single process with
``strategy="ddp"`` and no launcher joins a one-process group, which lets DDP scripts run
unchanged with plain ``python``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpukit.accelerators import Accelerator
from gpukit.errors import DistributedError
from gpukit.layout import Layout
from gpukit.placement import unwrap_model
from gpukit.strategies._env import DistEnv
from gpukit.strategies._lifecycle import leave_at_exit
from gpukit.strategies._syncbn import convert_sync_batchnorm
from gpukit.strategies.base import Strategy, check_reduce_op
from gpukit.worker import collective_timeout_s

__all__ = ["DDPStrategy"]

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "mean": "SUM"}


class DDPStrategy(Strategy):
    """Wrap the model in DistributedDataParallel; this process owns ``device``.

    Args:
        accelerator: the device type's accelerator (gives the backend).
        device: this process's device (its local GPU, or the CPU).
        env: the launch environment; ``None`` when not launched yet.
        num_processes: processes per node this strategy runs in.
        sync_batchnorm: convert BatchNorm layers to synchronised ones.
        timeout_s: collective timeout in seconds; ``None``: ``GPUKIT_TIMEOUT_S``, else 1800.
    """

    name = "ddp"

    def __init__(
        self,
        accelerator: Accelerator,
        device: torch.device,
        env: DistEnv | None,
        num_processes: int = 1,
        sync_batchnorm: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__(accelerator, device)
        self.env = env
        self._num_processes = env.local_world_size if env is not None else num_processes
        self.sync_batchnorm = sync_batchnorm
        self.timeout_s = collective_timeout_s(timeout_s)
        self._owns_group = False
        self._backend: str | None = None  # set: this node's processes share one GPU (see backend)

    @classmethod
    def for_process(cls, accelerator: Accelerator, device: torch.device, env: DistEnv | None, num_processes: int,
                    *, sync_batchnorm: bool = False, shares_gpu: bool = False) -> DDPStrategy:
        """This process's strategy of a job with a process per device (``strategies/_select.py`` calls it).

        Args:
            shares_gpu: this node's processes all see one GPU (run over gloo: nccl refuses two ranks
                on one device, gloo moves CUDA tensors).
        """
        strategy = cls(accelerator, device, env, num_processes=num_processes, sync_batchnorm=sync_batchnorm)
        if shares_gpu:
            strategy.backend = "gloo"
        return strategy

    @property
    def backend(self) -> str:
        """The process group's backend: the accelerator's (nccl on NVIDIA GPUs, gloo on the CPU),
        or gloo where this node's processes share one GPU (nccl refuses two ranks on one device)."""
        return self._backend or self.accelerator.distributed_backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = name

    @property
    def rank(self) -> int:
        return self.env.rank if self.env else 0

    @property
    def local_rank(self) -> int:
        return self.env.local_rank if self.env else 0

    @property
    def world_size(self) -> int:
        return self.env.world_size if self.env else self._num_processes

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def launched(self) -> bool:
        return self.env is not None or self._num_processes == 1

    @property
    def layout(self) -> Layout:
        return Layout(replicas=self.world_size)

    def setup_environment(self) -> None:
        super().setup_environment()
        backend = self.backend
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise DistributedError(
                    f"A process group of size {dist.get_world_size()} already exists, but this "
                    f"session expects world size {self.world_size}; destroy it first."
                )
            return
        timeout = timedelta(seconds=self.timeout_s)
        if self.env is None:
            # one process, no launcher: an in-memory store needs no port
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            if not self.env.master_addr or self.env.master_port is None:
                raise DistributedError(
                    f"WORLD_SIZE={self.env.world_size} is set but MASTER_ADDR/MASTER_PORT are not; "
                    "start the script with torchrun or `gpukit run`, which set all of them."
                )
            self.env.export()  # under SLURM (srun python ...) only SLURM_* are set
            try:
                dist.init_process_group(
                    backend, init_method="env://", rank=self.env.rank,
                    world_size=self.env.world_size, timeout=timeout,
                )
            except (RuntimeError, ValueError) as exc:
                raise DistributedError(
                    f"Could not join the process group ({backend}, rank {self.env.rank} of "
                    f"{self.env.world_size}, {self.env.master_addr}:{self.env.master_port}): {exc}"
                ) from exc
        self._owns_group = True
        leave_at_exit(self)  # barrier + destroy at exit: gloo's teardown must not abort a finished run

    def prepare_module(self, module: nn.Module) -> nn.Module:
        module = unwrap_model(module)
        if not self.sync_batchnorm:
            return module
        # torch's SyncBatchNorm refuses CPU tensors; HostSyncBatchNorm does the same on gloo
        if self.accelerator.is_host:
            return convert_sync_batchnorm(module)
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.checkpoint_activations(unwrap_model(module)).to(self.root_device)
        device_ids = [self.root_device] if self.root_device.index is not None else None
        return DistributedDataParallel(module, device_ids=device_ids)

    def precision_target(self, module: nn.Module) -> nn.Module:
        """The model inside the DDP wrapper: DDP's own forward (bucket hooks, the compiled wrapper's
        DDPOptimizer) stays as torch has it; the user's model runs under autocast inside it."""
        return module.module if isinstance(module, DistributedDataParallel) else module

    def no_backward_sync(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    # -- collectives -----------------------------------------------------------------------
    def barrier(self) -> None:
        if not dist.is_initialized():
            return
        if self._uses_nccl() and self.root_device.index is not None:
            # nccl's barrier is an all-reduce on some GPU: name ours, or torch picks the current
            # device (2.5+) or rank % GPUs (2.4) and may open a context on another process's GPU
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()  # gloo: device_ids is nccl-only (torch 2.4 raises for other backends)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        if isinstance(obj, torch.Tensor):
            out = obj.detach().to(self._collective_device(), copy=True)
            dist.broadcast(out, src)
            return out.to(obj.device)
        box = [obj]
        dist.broadcast_object_list(box, src, device=self._object_device())
        return box[0]

    def all_reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        check_reduce_op(op)
        tensor = self.as_tensor(value)
        if not dist.is_initialized():
            return tensor
        # a value on another device (e.g. a metric kept on the host under nccl) travels through
        # the backend's device and comes back where it was
        out = tensor.detach().to(self._collective_device(), copy=True)
        if op == "mean" and not out.is_floating_point():
            out = out.float()
        dist.all_reduce(out, op=getattr(dist.ReduceOp, _OPS[op]))
        if op == "mean":  # gloo has no AVG
            out /= dist.get_world_size()
        return out.to(tensor.device)

    def all_gather(self, value: torch.Tensor | float) -> torch.Tensor:
        tensor = self.as_tensor(value)
        if not dist.is_initialized():
            return tensor.unsqueeze(0)
        local = tensor.detach().to(self._collective_device()).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        return torch.stack(parts).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        # nccl moves the pickles through the current GPU, which setup_environment made this rank's
        dist.all_gather_object(out, obj)
        return out

    def _uses_nccl(self) -> bool:
        return self.backend == "nccl"

    def _collective_device(self) -> torch.device:
        # nccl only communicates GPU tensors (a CPU tensor fails with "No backend type associated
        # with device type cpu"); gloo communicates host tensors
        return self.root_device if self._uses_nccl() else torch.device("cpu")

    def _object_device(self) -> torch.device | None:
        # nccl moves pickled objects through the GPU; gloo through the CPU
        return self.root_device if self._uses_nccl() else None

    def describe(self) -> str:
        shared = (f" ({self.num_processes} processes share {self.root_device}: nccl needs a GPU per process)"
                  if self.backend != self.accelerator.distributed_backend else "")
        return (
            f"ddp rank {self.rank}/{self.world_size} on {self.root_device} "
            f"with {self.backend}{shared}{self._describe_checkpointing()}"
        )
