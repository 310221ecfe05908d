"""Worker for test_ddp_multiprocess.py, started by torchrun with 2 processes (gloo, CPU).

Trains a small BatchNorm MLP with Session(ddp, sync_batchnorm, accumulate 2) and records
what the test checks: sample indices per epoch, gradient sync under accumulation,
collectives, final parameters and BatchNorm statistics. Writes <out>/rank<R>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gpukit
from gpukit.placement import unwrap_model

N, FEATURES, BATCH, EPOCHS, ACCUM = 32, 6, 4, 2, 2


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, FEATURES, generator=g)
    y = torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def main(out_dir: Path) -> None:
    session = gpukit.Session(
        accelerator="cpu", seed=0, accumulate_grad_batches=ACCUM, sync_batchnorm=True,
        verbose=False,
    )
    model = make_model()  # right after seeding: same init as the test's reference
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(make_data(), batch_size=BATCH, shuffle=True)
    record: dict = {"strategy": session.strategy.name, "backend": torch.distributed.get_backend(),
                    "world_size": session.world_size, "rank": session.rank,
                    "indices": [], "grads_equal_after_micro": []}
    for _epoch in range(EPOCHS):
        for x, y, idx in loader:
            record["indices"].append(idx.tolist())
            with session.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                session.backward(loss)
            grad = unwrap_model(model)[0].weight.grad.detach().clone()
            both = session.all_gather(grad)
            record["grads_equal_after_micro"].append(bool(torch.equal(both[0], both[1])))
            session.step(optimizer)
    record["sync_bn_type"] = type(unwrap_model(model)[1]).__name__
    record["all_reduce"] = {
        op: session.all_reduce(torch.tensor(float(session.rank)), op=op).item()
        for op in ("sum", "mean", "max", "min")
    }
    record["broadcast"] = session.broadcast({"from": session.rank})
    record["state"] = {k: v.detach().clone() for k, v in unwrap_model(model).state_dict().items()}
    session.barrier()
    torch.save(record, out_dir / f"rank{session.rank}.pt")
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
