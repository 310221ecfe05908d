"""Worker for the loader-resume test (a script, not collected by pytest).

    python loader_resume_worker.py full   CKPT_ROOT OUT   # train N_STEPS per case, uninterrupted
    python loader_resume_worker.py crash  CKPT_ROOT OUT   # checkpoint at CRASH_AT, train on, block
    python loader_resume_worker.py resume CKPT_ROOT OUT   # resume each case, train to N_STEPS

Cases: num_workers 0 and 2, with and without random augmentation in ``__getitem__`` (torch,
numpy and python's random). The crash run keeps every case's loader (and its worker processes)
alive, prints their pids and blocks until the test SIGKILLs it.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import gpukit

N_STEPS, CRASH_AT = 23, 13  # 10 batches per epoch: the checkpoint is mid-epoch (epoch 1, batch 3)
CASES = [(workers, augment) for workers in (0, 2) for augment in (False, True)]


class Noisy(Dataset):
    def __init__(self, augment: bool) -> None:
        data = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(40, 8, generator=data), torch.randn(40, 1, generator=data)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.augment:
            x = x + torch.randn(8) * 0.1 + float(np.random.rand()) * random.random()
        return x, self.y[i]


def train_case(mode: str, root: Path, workers: int, augment: bool, keep: list) -> dict:
    session = gpukit.Session(accelerator="cpu", devices=1, seed=0, verbose=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = session.setup(model, opt)
    loader = session.setup_dataloader(Noisy(augment), batch_size=4, shuffle=True, num_workers=workers)
    ckpt = root / f"w{workers}-aug{int(augment)}"
    start = session.resume(ckpt, model=model, optimizer=opt, loader=loader) or 0 if mode == "resume" else 0
    sums: dict[int, str] = {}
    step = start
    while step < N_STEPS:
        for x, y in loader:
            step += 1
            sums[step] = repr(float(x.double().sum()))
            loss = nn.functional.mse_loss(model(x), y)
            session.backward(loss)
            session.step(opt)
            if mode == "crash" and step == CRASH_AT:
                session.save_checkpoint(ckpt, step, model=model, optimizer=opt, loader=loader)
            if step == N_STEPS or (mode == "crash" and step == CRASH_AT + 2):
                break
        if mode == "crash" and step == CRASH_AT + 2:
            keep.append(loader)  # the pass is cut short: its workers stay alive until the kill
            break
    return {"start": start, "sums": sums, "params": [p.detach().double().sum().item() for p in model.parameters()]}


def main(mode: str, root: Path, out: Path) -> None:
    torch.set_num_threads(1)
    keep: list = []
    results = {f"w{w}-aug{int(a)}": train_case(mode, root, w, a, keep) for w, a in CASES}
    out.write_text(json.dumps(results))
    if mode == "crash":
        print(f"AFTER {os.getpid()}", flush=True)
        sys.stdin.read()  # block until killed (the test never writes or closes stdin)
        raise SystemExit("crash worker was not killed")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
