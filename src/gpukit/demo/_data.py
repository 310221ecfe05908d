"""The 8x8 digits data set from scikit-learn, as tensors, split deterministically."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from gpukit.errors import ConfigurationError

__all__ = ["load_digits_split"]


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Return (train, test) datasets of ``(image (1, 8, 8) float32 in [0, 1], label int64)``.

    Raises:
        ConfigurationError: scikit-learn is not installed (it ships the data set).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            "The demo trains on scikit-learn's bundled digits data set, but scikit-learn is not "
            "installed. Install it with: pip install 'gpukit[demo]'"
        ) from exc
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )
