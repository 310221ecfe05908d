"""Two ranks all-reduce in a loop; rank 1 stops calling collectives at step 3 (a hang)."""

import pathlib
import sys
import time

import torch

import gpukit

out = pathlib.Path(sys.argv[1])
session = gpukit.Session(seed=0, verbose=False)
step = 0
while True:
    session.all_reduce(torch.ones(()))
    step += 1
    if session.rank == 1 and step == 3:
        (out / "stalling").write_text("1")
        while True:  # stuck in user code, never reaching the next collective
            time.sleep(0.05)
