"""original.py ported to gpukit: the "after" (port.diff is the whole change).

    python examples/mnist_port/with_gpukit.py --epochs 1 --synthetic 2048
    gpukit run --cpu --nproc 2 examples/mnist_port/with_gpukit.py --synthetic 2048   # DDP, unchanged

In one process it trains exactly as original.py does (the same losses, checked by
tests/examples/test_mnist_port.py); the device, the loaders' device copies, the shard of each
process, the seeding and the checkpoint that loads anywhere come from gpukit.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.optim.lr_scheduler import StepLR

import gpukit

from digits import load_data


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))                    # [B, 32, 26, 26]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # [B, 64, 12, 12]
        x = torch.flatten(self.dropout1(x), 1)       # [B, 9216]
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, session, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        loss = F.nll_loss(model(data), target)
        session.backward(loss)
        session.step(optimizer)  # steps, then zeroes the gradients
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]\tLoss: {loss.item():.6f}")
            if args.dry_run:
                break


def test(model, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += (output.argmax(dim=1) == target).sum().item()
    test_loss /= len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}")


def main():
    parser = argparse.ArgumentParser(description="MNIST, gpukit")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--no-accel", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true")
    parser.add_argument("--synthetic", type=int, default=0, help="N generated digits instead of MNIST")
    args = parser.parse_args()

    use_accel = not args.no_accel and torch.cuda.is_available()
    session = gpukit.Session(accelerator="auto" if use_accel else "cpu", seed=args.seed, precision="32-true")

    train_kwargs = {"batch_size": args.batch_size}
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_accel:
        accel_kwargs = {"num_workers": 1, "pin_memory": True, "shuffle": True}
        train_kwargs.update(accel_kwargs)
        test_kwargs.update(accel_kwargs)
    dataset1, dataset2 = load_data(args.synthetic)
    train_loader = session.setup_dataloader(torch.utils.data.DataLoader(dataset1, **train_kwargs))
    test_loader = session.setup_dataloader(torch.utils.data.DataLoader(dataset2, **test_kwargs))

    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    model, optimizer = session.setup(model, optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, session, model, train_loader, optimizer, epoch)
        test(model, test_loader)
        scheduler.step()

    if args.save_model:
        gpukit.save(model, "mnist_cnn.pt")  # no module. prefix, loads on a CPU-only machine
    session.close()


if __name__ == "__main__":
    main()
