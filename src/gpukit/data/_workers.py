"""DataLoader worker settings: the ``num_workers="auto"`` rule and worker seeding."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpukit._cpu import MAX_AUTO_WORKERS, auto_worker_count, usable_cpu_count
from gpukit.accelerators import Accelerator

__all__ = ["auto_num_workers", "seed_worker", "chain_worker_init", "MAX_AUTO_WORKERS"]


def auto_num_workers(dataset: Any, accelerator: Accelerator, local_world_size: int) -> int:
    """The ``num_workers="auto"`` rule.

    - 0 for an in-memory ``TensorDataset`` (indexing it costs nothing; workers only add IPC);
    - 0 when training on the CPU (the model's maths already uses every core);
    - otherwise ``usable CPUs // processes on this node - 1`` (one core left for the training
      loop of each process), capped at 8 and at least 0.
    """
    if isinstance(dataset, TensorDataset) or accelerator.is_host:
        return 0
    return auto_worker_count(usable_cpu_count(), local_world_size)


def seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's RNGs in a DataLoader worker from torch's per-worker seed.

    torch seeds each worker with ``base_seed + worker_id`` (``base_seed`` drawn from the
    loader's generator) but leaves ``random`` and ``numpy`` as forked copies, so every worker
    would otherwise produce the same "random" augmentations.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


class chain_worker_init:  # noqa: N801 - used like a function; a class so it pickles (spawn)
    """``seed_worker`` then the user's own ``worker_init_fn``."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)


