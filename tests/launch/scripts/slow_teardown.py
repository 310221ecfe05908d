"""Training that saves when told to stop, then tears down slowly -- as gloo's destructor did under
load (4-12 s) -- for longer than the launcher's --grace.

    slow_teardown.py OUT TEARDOWN_S
"""

import atexit
import os
import pathlib
import sys
import time

import torch

import gpukit

out = pathlib.Path(sys.argv[1])
teardown_s = float(sys.argv[2])
session = gpukit.Session(seed=0, verbose=False)
model = torch.nn.Linear(4, 1)
model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
(out / f"pid-{session.rank}").write_text(str(os.getpid()))
step = 0
while True:
    session.backward(model(torch.ones(2, 4)).sum())
    session.step(opt)
    step += 1
    if session.should_stop:
        session.save_checkpoint(out / "ckpt", step, model=model, optimizer=opt)
        (out / f"stopped-{session.rank}").write_text(str(step))
        atexit.register(time.sleep, teardown_s)  # the slow teardown, after the save
        sys.exit(0)
    time.sleep(0.01)
