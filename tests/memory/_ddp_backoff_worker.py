"""Worker for the 2-process OOM back-off test: rank 1 runs out of memory above 4 items."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from gpukit.memory import OomBackoff


class _NormNet(nn.Module):
    """Has buffers (DDP broadcasts them in forward); rank 1 runs out of memory *inside* forward."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.lin, self.bn = rank, nn.Linear(6, 3), nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 1 and x.shape[0] > 4:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return self.bn(self.lin(x))


def main_norm(store_file: str, out_file: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_NormNet(rank))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    batch = (torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator))

    def step(micro: tuple[torch.Tensor, torch.Tensor], weight: float) -> float:
        loss = nn.functional.mse_loss(ddp(micro[0]), micro[1]) * weight
        loss.backward()
        return loss.item()

    backoff = OomBackoff(16, zero_grad=opt.zero_grad, parameters=ddp.parameters(), no_sync=ddp.no_sync)
    backoff.run(step, batch)
    backoff.run(step, batch)
    with open(out_file, "w") as handle:
        json.dump({"rank": rank, "micro_batch_size": backoff.micro_batch_size}, handle)
    dist.barrier()
    dist.destroy_process_group()


def main(store_file: str, out_file: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    torch.manual_seed(0)  # same initial weights everywhere
    model = nn.Linear(6, 3)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batch = (torch.randn(16, 6, generator=generator), torch.randn(16, 3, generator=generator))

    def step(micro: tuple[torch.Tensor, torch.Tensor], weight: float) -> float:
        if rank == 1 and micro[0].shape[0] > 4:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        loss = nn.functional.mse_loss(ddp(micro[0]), micro[1]) * weight
        loss.backward()
        return loss.item()

    backoff = OomBackoff(16, zero_grad=opt.zero_grad, parameters=ddp.parameters(), no_sync=ddp.no_sync)
    backoff.run(step, batch)
    grads = [p.grad.tolist() for p in model.parameters()]
    second_micro = backoff.micro_batch_size
    backoff.run(step, batch)  # a second step keeps the agreed size and does not back off again
    result = {
        "rank": rank,
        "micro_batch_size": backoff.micro_batch_size,
        "second_micro": second_micro,
        "accumulation_steps": backoff.accumulation_steps,
        "events": len(backoff.events),
        "grads": grads,
        "batch": [t.tolist() for t in batch],
    }
    with open(out_file, "w") as handle:
        json.dump(result, handle)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    (main_norm if sys.argv[3:] == ["norm"] else main)(sys.argv[1], sys.argv[2])
    # The results are written and the group is destroyed; skip interpreter teardown, where
    # gloo's background threads occasionally abort the process ("terminate called without an
    # active exception", rc -6) after the work is done -- a torch teardown race, not ours.
    sys.stdout.flush()
    os._exit(0)
