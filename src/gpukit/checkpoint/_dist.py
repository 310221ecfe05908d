"""What the checkpoint code needs from ``torch.distributed``: rank, world size, a few collectives.

Read from ``torch.distributed`` directly (not from a Session) so plain DDP scripts get
rank-0-only writes too. Without an initialised process group this is one process, rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistContext", "current_dist"]


@dataclass(frozen=True)
class DistContext:
    """The rank of this process and the size of its process group."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        if dist.get_backend() == "nccl":
            # nccl's barrier runs on a GPU: the current one (what DDP scripts and gpukit's DDP
            # strategy set), named so torch 2.4 does not guess rank % GPUs and 2.5+ does not warn
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()  # device_ids is nccl-only

    def broadcast_from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a picklable object)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_all(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def current_dist() -> DistContext:
    """The distributed context of this process (rank 0 of 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
    return DistContext()
