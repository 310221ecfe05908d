"""Worker for test_ckpt_sharded.py: FSDP training with sharded checkpoints (not collected by pytest).

    gpukit run --cpu --nproc W ckpt_sharded_worker.py CKPT OUT [--save 2,4] [--kill-after 5]
        train to STEPS under Session(strategy="fsdp"), resuming from CKPT's latest checkpoint
        when there is one; save at the listed steps; rank 0 SIGKILLs itself after --kill-after;
        at the end rank 0 writes OUT (the full parameters and where it resumed from);
        --wider builds a wider model (resuming a checkpoint of the normal one must fail);
        --background saves in the background (training goes on while the shards are written;
        rank 0 waits for the last save to be complete before it kills itself).
    RANK=r WORLD_SIZE=2 ... python ckpt_sharded_worker.py CKPT OUT --faults
        (plain processes, no launcher to kill the survivors) save step 1; then a save where
        rank 1's disk is full; then a save during which rank 1 is SIGKILLed. Rank 0 writes
        what each save raised and what latest() saw to OUT (--background: what
        wait_for_saves() raised after each background save).

Every step's global batch is the same whatever the number of processes (rank r takes its
slice), so runs at 1 and 2 processes compute the same training up to float rounding.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager

STEPS, GLOBAL_BATCH, SAMPLES, WIDTH = 6, 8, 48, 12


class Stack(nn.Module):
    """Input layer, a stack of MLP blocks (each one FSDP unit), output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(SAMPLES, 6, generator=data), torch.randn(SAMPLES, 1, generator=data)
    chosen = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1000 + step))[:GLOBAL_BATCH]
    per_rank = GLOBAL_BATCH // world
    mine = chosen[rank * per_rank:(rank + 1) * per_rank]
    return x[mine], y[mine]


def build(session: gpukit.Session) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = session.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def train(args: argparse.Namespace) -> None:
    global WIDTH
    WIDTH += 4 if args.wider else 0  # another architecture: resuming must refuse it
    session = gpukit.Session(strategy="fsdp", verbose=False)
    model, optimizer, scheduler = build(session)
    start = session.resume(args.ckpt, model=model, optimizer=optimizer, scheduler=scheduler) or 0
    for step in range(start + 1, STEPS + 1):
        x, y = session.to_device(batch(step, session.rank, session.world_size))
        session.backward(nn.functional.mse_loss(model(x), y))
        session.step(optimizer)
        scheduler.step()
        if step in args.save:
            session.save_checkpoint(args.ckpt, step, keep_last=2, model=model, optimizer=optimizer,
                                    scheduler=scheduler, background=args.background)
        if step == args.kill_after and session.rank == 0:
            if args.background:  # the last save complete (every rank's part: it committed), then the crash
                gpukit.checkpoint.wait_for_saves()
            os.kill(os.getpid(), signal.SIGKILL)
    state = full_state(model)
    if session.rank == 0:
        torch.save({"state": state, "start": start, "world_size": session.world_size}, args.out)
    session.close()


def faults(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    session = gpukit.Session(strategy="fsdp", verbose=False)
    model, optimizer, scheduler = build(session)
    session.backward(model(session.to_device(batch(1, session.rank, 2)[0])).sum())
    session.step(optimizer)
    manager = CheckpointManager(args.ckpt)
    report: dict = {}
    real_write = dcp_fs._write_item

    def disk_full(*a: object, **k: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device")

    def killed(*a: object, **k: object) -> object:
        os.kill(os.getpid(), signal.SIGKILL)
        return real_write(*a, **k)

    for step, fault in ((1, None), (2, disk_full), (3, killed)):
        if session.rank == 1 and fault is not None:
            dcp_fs._write_item = fault
        try:
            session.save_checkpoint(args.ckpt, step, model=model, optimizer=optimizer, background=args.background)
            if args.background:
                gpukit.checkpoint.wait_for_saves()
            report[str(step)] = "saved"
        except gpukit.errors.CheckpointError as exc:
            report[str(step)] = str(exc)
        report[f"latest_after_{step}"] = str(manager.latest())
    if session.rank == 0:
        Path(args.out).write_text(json.dumps(report))
    os._exit(0)  # the process group lost a member: leave without a (hanging) teardown


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--save", type=lambda s: {int(v) for v in s.split(",") if v}, default=set())
    parser.add_argument("--kill-after", type=int, default=-1)
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--wider", action="store_true")
    parser.add_argument("--background", action="store_true")
    parsed = parser.parse_args()
    sys.exit(faults(parsed) if parsed.faults else train(parsed))
