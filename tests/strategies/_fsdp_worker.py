"""Worker for test_fsdp_multiprocess.py, started by `gpukit run --cpu --nproc 2` (gloo, CPU).

It trains a small transformer with Session(strategy="fsdp"), then the same loop by hand
with torch's DistributedDataParallel on the same batches -- SGD with momentum, accumulation 2 and gradient clipping
that bites (AdamW would amplify float noise in the attention key bias, whose true gradient
is 0), and records what the test compares: sample indices, final full parameters, per-rank shard sizes,
whether the sharded gradients appeared before the accumulation boundary. Writes
<out>/rank<R>.pt.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit

N, SEQ, FEATURES, BATCH, EPOCHS, ACCUM, CLIP = 32, 5, 8, 4, 2, 2, 0.05


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, SEQ, FEATURES, generator=g)
    y = torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def train_ddp(batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> dict:
    """The same loop by hand with torch's DistributedDataParallel, on the same batches."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        TinyTransformer().to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        sync = (i + 1) % ACCUM == 0
        with contextlib.nullcontext() if sync else model.no_sync():
            (nn.functional.mse_loss(model(x), y) / ACCUM).backward()
        if sync:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    return {"state": {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()},
            "local_param_numel": sum(p.numel() for p in model.parameters()),
            "local_optimizer_numel": sum(s["momentum_buffer"].numel() for s in optimizer.state.values())}


def main(out_dir: Path) -> None:
    session = gpukit.Session(  # the CPU under `gpukit run --cpu`, GPUs under `--gpus 2`
        strategy="fsdp", precision="32-true", seed=0, accumulate_grad_batches=ACCUM, verbose=False
    )
    model = TinyTransformer()  # right after seeding: the test's reference has the same init
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    loader = session.setup_dataloader(make_data(), batch_size=BATCH, shuffle=True)
    record: dict = {"strategy": session.strategy.name, "world_size": session.world_size,
                    "indices": [], "grad_before_boundary": [], "units": session.strategy.units}
    batches = []
    for _epoch in range(EPOCHS):
        for x, y, idx in loader:
            record["indices"].append(idx.cpu().tolist())
            batches.append((x, y))
            with session.accumulate(model):
                session.backward(nn.functional.mse_loss(model(x), y))
            record["grad_before_boundary"].append(
                any(p.grad is not None for p in optimizer.param_groups[0]["params"]))
            session.step(optimizer, clip_grad_norm=CLIP)
    record["state"] = {k: v.cpu() for k, v in full_state(model).items()}
    record["local_param_numel"] = sum(p.to_local().numel() for p in model.parameters())
    record["local_optimizer_numel"] = sum(
        s["momentum_buffer"].to_local().numel() for s in optimizer.state.values())
    record["ddp"] = train_ddp(batches, session.device)
    session.barrier()
    torch.save(record, out_dir / f"rank{session.rank}.pt")
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
