"""Seeding of every random number generator a training process uses.

Documented scheme (per-rank offsets where noted):
- Python ``random``, NumPy, torch's CPU generator and every GPU: ``seed`` on every rank, so
  models built before ``setup`` start identical everywhere (DDP also broadcasts rank 0's).
- Shuffling: ``seed + epoch`` on every rank (DistributedSampler needs the same permutation on
  all ranks; each takes its own slice of it).
- DataLoader workers: base seed drawn from a generator seeded with ``seed + rank``; each worker
  seeds ``random`` and NumPy from torch's per-worker seed, so augmentations differ per worker
  and per rank.
"""

from __future__ import annotations

import os
import random

import torch

from gpukit.accelerators import Accelerator

__all__ = ["seed_everything", "fresh_seed"]

_MAX_SEED = 2**31 - 1


def seed_everything(seed: int, accelerator: Accelerator | None = None) -> int:
    """Seed Python, NumPy, torch and every device of ``accelerator`` with ``seed``.

    Also exports ``PYTHONHASHSEED`` for child processes (it cannot change this one's).

    Returns:
        The seed (as an int).
    """
    seed = int(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)
    if accelerator is not None:
        accelerator.manual_seed_all(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    return seed


def fresh_seed() -> int:
    """A random seed from the OS, leaving every seeded generator's stream untouched."""
    return int.from_bytes(os.urandom(4), "little") % _MAX_SEED
