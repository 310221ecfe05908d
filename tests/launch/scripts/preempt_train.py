"""Training with loader worker processes that checkpoints and leaves when told to stop.

    preempt_train.py OUT    # writes OUT/pid-RANK once its loader workers run, then trains until
                            # session.should_stop; saves OUT/ckpt and writes OUT/stopped-RANK
"""

import os
import pathlib
import sys
import time

import torch
from torch.utils.data import Dataset

import gpukit


class Squares(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        x = torch.full((4,), float(i % 97) / 97)
        return x, x.sum(dim=0, keepdim=True)


out = pathlib.Path(sys.argv[1])
torch.set_num_threads(1)
session = gpukit.Session(seed=0, verbose=False)
net = torch.nn.Linear(4, 1)
model, opt = session.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
loader = session.setup_dataloader(Squares(), batch_size=8, shuffle=True, num_workers=2)
step = 0
for epoch in range(1000):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step(opt)
        step += 1
        if step == 1:  # the loader's worker processes are running now
            (out / f".pid-{session.rank}").write_text(str(os.getpid()))
            os.replace(out / f".pid-{session.rank}", out / f"pid-{session.rank}")  # seen whole
        if session.should_stop:
            session.save_checkpoint(out / "ckpt", step, model=model, optimizer=opt, loader=loader)
            (out / f".stopped-{session.rank}").write_text(str(step))
            os.replace(out / f".stopped-{session.rank}", out / f"stopped-{session.rank}")
            session.close()
            raise SystemExit(0)
        time.sleep(0.005)  # leave the shared CPU to the other processes of the test
