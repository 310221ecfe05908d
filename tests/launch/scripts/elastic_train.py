"""A training job for the lost-node tests: run by `gpukit run --nnodes 1:2` agents (not collected).

    elastic_train.py OUT CKPT STEPS SAVE_EVERY STEP_S

Resumes CKPT's latest checkpoint (at whatever size it was saved), trains to STEPS optimizer steps,
checkpointing every SAVE_EVERY and when stopped (SIGTERM: saves, exits); STEP_S seconds of stand-in compute per micro-batch keep it long
enough to lose a node in the middle. Every rank appends one JSON line per event to
``OUT/events-RANK-PID.jsonl``: ``start`` (its pid, world size, the step resumed from, wall time)
and ``step`` (step, world size, accumulation, the ids trained, wall time).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gpukit

SAMPLES, MICRO_BATCH, GLOBAL_BATCH = 240, 2, 8


class Ids(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def main(out: Path, ckpt: Path, steps: int, save_every: int, step_s: float) -> None:
    torch.set_num_threads(1)
    started = time.time()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    session = gpukit.Session(accelerator="cpu", strategy="ddp", seed=0, verbose=True,
                             global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH)
    log = open(out / f"events-{session.rank}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = session.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    loader = session.setup_dataloader(Ids(), shuffle=True, num_workers=0)
    step = session.resume(ckpt, model=model, optimizer=optimizer, loader=loader) or 0
    log.write(json.dumps({"event": "start", "pid": os.getpid(), "world": world, "resumed": step,
                          "process_start": started, "t": time.time()}) + "\n")
    window: list[int] = []
    stop = False
    while step < steps:
        for xb, yb, ids in loader:
            time.sleep(step_s)  # stand-in compute: the job must last long enough to lose a node in it
            window += [int(i) for i in ids]
            session.backward(nn.functional.mse_loss(model(xb), yb))
            if session.step(optimizer):
                step += 1
                log.write(json.dumps({"event": "step", "step": step, "world": world, "epoch": loader.epoch,
                                      "accumulate": session.accumulate_grad_batches, "ids": window,
                                      "t": time.time()}) + "\n")
                window = []
                # the loop docs/launching.md recommends: a stop (the agent's, to re-form the group) saves
                stop = session.should_stop  # one all-reduce: every rank the same answer
                if step % save_every == 0 or stop:
                    session.save_checkpoint(ckpt, step, model=model, optimizer=optimizer, loader=loader)
                if step >= steps or stop:
                    break
        if stop:
            break
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
