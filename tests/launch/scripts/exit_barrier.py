"""A finished run whose Session some ranks dropped before exit: every rank still meets at the
exit barrier. (runpy drops the script's globals before the exit hooks run, so a Session without a
reference cycle is gone by then on some ranks and alive on others; here rank 0 keeps it.)"""

import builtins
import gc

import torch
from torch import nn

import gpukit

session = gpukit.Session(accelerator="cpu", verbose=False)
layer = nn.Linear(4, 1)
model, optimizer = session.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
session.backward(model(torch.randn(2, 4)).sum())
session.step(optimizer)
if session.rank == 0:
    builtins._gpukit_test_session = session  # type: ignore[attr-defined]
del session, model, optimizer, layer
gc.collect()
