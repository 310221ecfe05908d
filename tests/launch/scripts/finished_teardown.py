"""Training that ends by itself, then tears down slowly: a warning that lands in the teardown
comes after the training.

    finished_teardown.py OUT
"""

import atexit
import pathlib
import sys
import time

import torch

import gpukit

out = pathlib.Path(sys.argv[1])
session = gpukit.Session(seed=0, verbose=False)
model = torch.nn.Linear(4, 1)
model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(3):
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    if session.should_stop:
        sys.exit("asked to stop during the training: the test wanted the warning after it")
(out / f"trained-{session.rank}").write_text("3")
atexit.register(time.sleep, 3)  # a teardown that takes a while (gloo's took 4-12 s under load)
atexit.register(lambda: (out / f"teardown-{session.rank}").write_text("started"))
