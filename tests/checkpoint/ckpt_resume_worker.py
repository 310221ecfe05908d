"""Training worker for the exact-resume test (run as a script, not collected by pytest).

    python ckpt_resume_worker.py full   CKPT_DIR OUT   # train N_STEPS uninterrupted
    python ckpt_resume_worker.py crash  CKPT_DIR OUT   # checkpoint at CRASH_AT, train on, block
    python ckpt_resume_worker.py resume CKPT_DIR OUT   # resume the latest checkpoint, train to N_STEPS
    ... MODE CKPT_DIR OUT RANK WORLD INIT_FILE        # the same as one rank of a DDP job (gloo)

The step draws from every generator a real loop uses: a shuffling loader (torch generator
per epoch), dropout (torch CPU RNG), noise from numpy and scale from python's random. Under
DDP each rank reads its own shard and seeds its generators differently, so restoring rank 0's
RNG or data position on rank 1 would show up as a difference.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager

N_STEPS = 23
CRASH_AT = 13  # 10 batches per epoch: the checkpoint is taken mid-epoch (epoch 1, batch 3)
SAVE_EVERY = {7, CRASH_AT}
BATCH, SAMPLES = 4, 40


class ResumableLoader:
    """Shuffled batches over epochs; state_dict gives the exact position (mid-epoch too)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rank: int, world: int, seed: int = 123) -> None:
        self.x, self.y, self.seed, self.rank, self.world = x, y, seed, rank, world
        self.epoch, self.batches_consumed = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches = len(self.x) // self.world // BATCH
        while True:
            shuffled = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = shuffled[self.rank :: self.world]  # this rank's shard, as DistributedSampler
            for index in range(self.batches_consumed, batches):
                self.batches_consumed = index + 1
                chosen = order[index * BATCH : (index + 1) * BATCH]
                yield self.x[chosen], self.y[chosen]
            self.epoch, self.batches_consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches_consumed = state["epoch"], state["batches_consumed"]


def main(mode: str, ckpt_dir: Path, out: Path, rank: int = 0, world: int = 1, init: str = "") -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(SAMPLES, 8, generator=data), torch.randn(SAMPLES, 1, generator=data)
    loader = ResumableLoader(x, y, rank, world)
    model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        model = nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(100 + rank)  # per-rank streams: dropout masks differ between ranks
    random.seed(rank)
    np.random.seed(rank)
    manager = CheckpointManager(ckpt_dir, keep_last=2)
    start = 0
    if mode == "resume":
        start = manager.resume(model=model, optimizer=opt, scheduler=sched, loader=loader)
        print(f"RESUMED {start} epoch={loader.epoch} batches={loader.batches_consumed}", flush=True)
    batches = iter(loader)
    for step in range(start + 1, N_STEPS + 1):
        x, y = next(batches)
        x = x + torch.from_numpy(np.random.normal(size=x.shape)).float() * 0.01 * random.random()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if mode == "crash" and step in SAVE_EVERY:
            manager.save(step, model=model, optimizer=opt, scheduler=sched, loader=loader)
            print(f"SAVED {step} epoch={loader.epoch} batches={loader.batches_consumed}", flush=True)
        if mode == "crash" and step == CRASH_AT + 2:
            print(f"AFTER {step}", flush=True)  # state has moved past the checkpoint: kill me now
            sys.stdin.read()  # block until killed (the test never writes or closes stdin)
            raise SystemExit("crash worker was not killed")
    gpukit.save({"model": model, "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                 "loader": loader.state_dict(), "rng_probe": torch.rand(4)}, out, rank_zero_only=False)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    extra = sys.argv[4:7]
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *(int(a) for a in extra[:2]), *extra[2:])
