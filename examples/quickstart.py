"""The README's quickstart, verbatim (tests/examples/test_readme_quickstart.py keeps them equal)."""

import torch, gpukit
from torch import nn

session = gpukit.Session(precision="auto", seed=0)          # devices, strategy chosen and printed
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = session.setup(model, optimizer)           # placed, DDP-wrapped, precision set
data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,)))
loader = session.setup_dataloader(data, batch_size=64, shuffle=True)   # sharded, on device

step = session.resume("ckpt", model=model, optimizer=optimizer, loader=loader) or 0
for epoch in range(loader.epoch, 10):                       # resumes mid-epoch too
    for x, y in session.progress(loader):
        with session.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        session.backward(loss)
        session.step(optimizer)
        step += 1
        if session.should_stop:                               # SIGTERM on any rank: all agree
            session.save_checkpoint("ckpt", step, model=model, optimizer=optimizer, loader=loader)
            raise SystemExit(0)                               # gpukit run exits 75: requeue me
    session.save_checkpoint("ckpt", step, model=model, optimizer=optimizer, loader=loader)
