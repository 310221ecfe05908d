"""Seeding of every random number generator a training process uses.

Documented scheme (per-rank offsets where noted):
- Python ``random``, NumPy, torch's CPU generator and every GPU: ``seed`` on every rank, so
  models built before ``setup`` start identical everywhere (DDP also broadcasts rank 0's).
- Shuffling: ``seed + epoch`` on every rank (DistributedSampler needs the same permutation on
  all ranks; each takes its own slice of it).
- DataLoader workers: base seed drawn from a generator seeded with ``seed + rank``; each worker
  seeds ``random`` and NumPy from torch's per-worker seed, so augmentations differ per worker
  and per rank.
- ``seed_per_rank=True``: after ``setup``, Python, NumPy and torch are reseeded with ``seed + rank``
  (:class:`RankSeeding`), for scripts that draw their batches from those generators.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch

from gpukit._util.warnings import warn_at_user_code
from gpukit.accelerators import Accelerator

__all__ = ["RankSeeding", "SameRandomStreamWarning", "fresh_seed", "seed_everything"]

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


class SameRandomStreamWarning(UserWarning):
    """Every rank drew its first batch from the same random stream and trained on the same data."""


class RankSeeding:
    """``Session(seed=S)`` across ranks: the same stream everywhere, or ``seed + rank`` after ``setup``.

    With ``seed_per_rank=True`` every rank is seeded with ``S`` until ``setup`` returns (models built
    before it start identical, which FSDP needs: it does not broadcast), then with ``S + rank``, so a
    script that samples its batches with ``torch.randint`` (nanoGPT's ``get_batch``) draws a different
    batch on each rank. Without it, such a script trains every rank on the same data; the first
    ``backward`` of a seeded multi-process run that does not take its batches from a gpukit loader
    checks for that (one all-gather of the first loss) and warns when all ranks' losses are identical.

    Args:
        seed: the session's seed, ``None``: not seeded (nothing to do).
        rank, world_size: where this process sits.
        accelerator: its devices are seeded too.
        per_rank: reseed with ``seed + rank`` after ``setup``.
    """

    def __init__(self, seed: int | None, rank: int, world_size: int, accelerator: Accelerator,
                 per_rank: bool) -> None:
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.per_rank = bool(per_rank)
        self._accelerator = accelerator
        self._checked = seed is None or world_size == 1 or self.per_rank

    def regroup(self, rank: int, world_size: int) -> None:
        """New data-parallel coordinates (``tensor_parallel="auto"`` chose tensor groups at setup)."""
        self.rank, self.world_size = rank, world_size
        self._checked = self.seed is None or world_size == 1 or self.per_rank

    def after_setup(self) -> None:
        """Switch to ``seed + rank`` (``seed_per_rank=True``)."""
        if self.per_rank and self.seed is not None:
            seed_everything(self.seed + self.rank, self._accelerator)

    def check_first_loss(self, loss: torch.Tensor, from_gpukit_loader: bool,
                         all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Warn once when every rank's first loss is the same (the same batch everywhere)."""
        if self._checked:
            return
        self._checked = True
        if from_gpukit_loader:  # its sampler gives each rank its own shard
            return
        losses = all_gather(loss.detach().float().reshape(()))
        if bool((losses == losses[0]).all()):
            warn_at_user_code(SameRandomStreamWarning(
                f"All {self.world_size} ranks computed the same first loss ({float(losses[0]):.6g}): they "
                f"trained on the same batch. Session(seed={self.seed}) seeds every rank alike, so a script "
                "that samples batches with torch.randint / np.random draws the same ones everywhere. Use "
                f"Session(seed={self.seed}, seed_per_rank=True) (seed + rank after setup), or "
                "session.setup_dataloader(dataset), which gives each rank its own shard."
            ))
