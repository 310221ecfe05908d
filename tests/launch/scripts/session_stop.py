"""A training-like loop that stops when `session.should_stop` says so (used by tests)."""

import os
import pathlib
import sys

import torch

import gpukit

out = pathlib.Path(sys.argv[1])
session = gpukit.Session(seed=0, verbose=False)
(out / f"pid-{session.rank}").write_text(str(os.getpid()))
step = 0
while True:
    session.all_reduce(torch.ones(()))  # stands in for a training step's collectives
    step += 1
    if session.should_stop:
        break
(out / f"stopped-{session.rank}").write_text(str(step))
from gpukit.worker import agreed_stop_signal  # noqa: E402 - what the ranks agreed to stop on

(out / f"agreed-{session.rank}").write_text(str(agreed_stop_signal()))
session.close()
