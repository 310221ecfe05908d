"""DataLoader worker settings: the ``num_workers="auto"`` rule, worker seeding and safety.

Every worker of a loader gpukit builds (``chain_worker_init``):
- ignores SIGTERM/SIGINT: a scheduler's or ``gpukit run``'s stop reaches the whole process
  group, and a loader worker that died of it would kill the training process ("DataLoader
  worker ... killed by signal: Terminated") before it could save. The training process
  handles the stop and shuts its loaders down; the worker still dies with it (below).
  Because multiprocessing stops daemonic children at exit with SIGTERM and then waits for
  them, the training process shuts these worker pools down itself first (an ``atexit`` hook
  that runs before multiprocessing's): the same orderly shutdown torch does when a loader's
  iterator is garbage-collected, then SIGKILL for a worker that does not leave;
- dies with the training process (``PR_SET_PDEATHSIG`` on Linux, on top of torch's own
  5-second parent poll), so a SIGKILLed trainer leaves no worker behind;
- seeds ``random``/NumPy/torch per worker, and again before each batch of a resumable loader
  from the batch's own seed (``seed_batch``), so augmentations resume exactly.
"""

from __future__ import annotations

import atexit
import random
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpukit._util.cpu import MAX_AUTO_WORKERS, auto_worker_count, usable_cpu_count
from gpukit._util.process import ignore_stop_signals, set_parent_death_signal
from gpukit.accelerators import Accelerator

__all__ = [
    "auto_num_workers", "seed_worker", "seed_batch", "chain_worker_init", "track_worker_pool",
    "MAX_AUTO_WORKERS",
]


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
    _seed_python_and_numpy(torch.initial_seed())


def seed_batch(seed: int) -> None:
    """In a DataLoader worker, seed torch, ``random`` and NumPy with a batch's own seed.

    A no-op in the main process (``num_workers=0``), whose generators belong to the training
    loop and are saved and restored with its checkpoints.
    """
    if torch.utils.data.get_worker_info() is None:
        return
    torch.manual_seed(seed)
    _seed_python_and_numpy(seed)


def _seed_python_and_numpy(seed: int) -> None:
    seed = seed % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


class chain_worker_init:  # noqa: N801 - used like a function; a class so it pickles (spawn)
    """Stop signals ignored, death with the parent, ``seed_worker``, then the user's own
    ``worker_init_fn`` (which may re-enable signals if it really wants them)."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        ignore_stop_signals()
        set_parent_death_signal()
        seed_worker(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)




_pools: weakref.WeakSet[Any] = weakref.WeakSet()  # DataLoaders whose workers ignore SIGTERM


def track_worker_pool(loader: Any) -> None:
    """Shut ``loader``'s persistent worker processes down at interpreter exit (see above)."""
    if not _pools:
        # registered after multiprocessing's own exit hook, so it runs before it (LIFO)
        atexit.register(_shutdown_worker_pools)
    _pools.add(loader)


def _shutdown_worker_pools() -> None:
    for loader in list(_pools):
        iterator = getattr(loader, "_iterator", None)
        if iterator is None or not hasattr(iterator, "_shutdown_workers"):
            continue
        try:
            iterator._shutdown_workers()  # asks each worker to leave, joins, closes queues
        except Exception:  # noqa: BLE001 - exit must go on; the SIGKILL below still applies
            pass
        for worker in getattr(iterator, "_workers", []):
            if worker.is_alive():
                worker.kill()  # it ignores SIGTERM; multiprocessing would wait for it forever
                worker.join(timeout=5)
    _pools.clear()
