"""The classic "train a classifier" tutorial, rewritten with gpukit.

The tutorial's boilerplate (``device = torch.device("cuda:0" if ... else "cpu")``,
``net.to(device)``, ``inputs.to(device)`` in the loop, ``total_loss += loss`` keeping graphs
alive) is replaced by a Session. Runs on a GPU, an Apple GPU or the CPU unchanged:

    python examples/single_device.py --epochs 2
    python examples/single_device.py --precision bf16-mixed    # on a recent GPU

The data are synthetic CIFAR-10-shaped images (no download): the class decides which
quadrant of the image is brighter, so the network can actually learn it.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpukit


class Net(nn.Module):
    """The tutorial's LeNet-style network for 3x32x32 images and 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 32, 32)
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 14, 14)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 5, 5)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)  # (B, 10) logits


def synthetic_cifar(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 32, 32, generator=g) * 0.5
    for cls in range(10):  # brighten a class-specific 8x8 patch
        row, col = divmod(cls, 4)
        images[labels == cls, :, row * 8:(row + 1) * 8, col * 8:(col + 1) * 8] += 1.0
    return TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()

    session = gpukit.Session(devices="auto", precision=args.precision, seed=0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    train = session.setup_dataloader(synthetic_cifar(args.samples, 1), batch_size=32, shuffle=True)
    test = session.setup_dataloader(synthetic_cifar(512, 2), batch_size=128, shuffle=False)

    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros((), device=session.device)  # a tensor: no sync per step
        for images, labels in session.progress(train, description=f"epoch {epoch}"):
            with session.autocast():
                loss = F.cross_entropy(model(images), labels)
            session.backward(loss)
            session.step(optimizer)
            running += loss.detach()  # .detach(): do not keep every step's graph alive
        session.print(f"epoch {epoch}: mean loss {running.item() / len(train):.3f}")

    model.eval()
    correct = total = 0
    with torch.no_grad(), session.autocast():  # inference without building graphs
        for images, labels in test:
            correct += (model(images).argmax(1) == labels).sum().item()
            total += labels.numel()
    session.print(f"accuracy on {total} test images: {100 * correct / total:.1f}%")


if __name__ == "__main__":
    main()
