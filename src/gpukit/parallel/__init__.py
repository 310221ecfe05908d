"""Model parallelism in one process: consecutive layers of a model on several devices,
pipelined over micro-batches (GPipe's fill-drain schedule).

    split_model = gpukit.parallel.split(model, devices=["cuda:0", "cuda:1"], chunks=4)
    loss = loss_fn(split_model(x), y.to(split_model.output_device))

``Session(strategy="pipeline", devices=[0, 1])`` does the same through a Session.
"""

from __future__ import annotations

from gpukit.parallel._balance import LayerCost, partition
from gpukit.parallel._pipeline import SplitModel, Stage
from gpukit.parallel._split import check_chunks, resolve_stage_devices, split

__all__ = ["LayerCost", "SplitModel", "Stage", "check_chunks", "partition", "resolve_stage_devices", "split"]
