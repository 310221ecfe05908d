"""The data both scripts train on: torchvision's MNIST (downloaded on first use), or, with
``--synthetic N`` or where torchvision is missing, N generated 28x28 "digits" (a class's stroke
pattern plus noise: learnable, reproducible, no download)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset


def _generated(count: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234)) > 0.8
    labels = torch.randint(0, 10, (count,), generator=g)
    images = patterns[labels].float() + 0.3 * torch.randn(count, 1, 28, 28, generator=g)
    return TensorDataset((images - 0.1307) / 0.3081, labels)


def load_data(synthetic: int) -> tuple[Dataset, Dataset]:
    """``(train, test)`` datasets."""
    if synthetic:
        return _generated(synthetic, 0), _generated(max(synthetic // 4, 1), 1)
    try:
        from torchvision import datasets, transforms
    except ImportError:
        print("torchvision is not installed: training on 8192 generated digits (--synthetic)")
        return _generated(8192, 0), _generated(2048, 1)
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    return (datasets.MNIST("../data", train=True, download=True, transform=transform),
            datasets.MNIST("../data", train=False, transform=transform))
