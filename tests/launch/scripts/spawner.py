"""A worker that starts processes of its own: a subprocess and DataLoader workers, then waits."""

import os
import pathlib
import subprocess
import sys
import time

import torch
from torch.utils.data import Dataset

import gpukit


class Items(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int):
        return torch.tensor([float(i)])


out = pathlib.Path(sys.argv[1])
session = gpukit.Session(seed=0, verbose=False)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # no PDEATHSIG of its own
loader = session.setup_dataloader(Items(), batch_size=4, num_workers=2)
batches = iter(loader)
next(batches)  # the loader's workers run now
(out / f".ready-{session.rank}").write_text(str(os.getpid()))
os.replace(out / f".ready-{session.rank}", out / f"ready-{session.rank}")
while True:
    time.sleep(0.1)
