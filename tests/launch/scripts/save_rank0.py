"""The classic mistake: a collective save under `if session.is_main:`."""

import pathlib
import sys

import torch

import gpukit

out = pathlib.Path(sys.argv[1])
session = gpukit.Session(seed=0, verbose=False)
if session.is_main:
    gpukit.save({"w": torch.ones(2)}, out / "weights.pt")
session.all_reduce(torch.ones(()))
