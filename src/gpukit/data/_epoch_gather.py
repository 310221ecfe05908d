"""Every rank's epoch totals for the end-of-epoch report, without a collective.

The report used to ``all_gather`` the totals when a pass over a sharded loader ended. That is a
collective, so a pass run on rank 0 alone (``if session.is_main: evaluate(val_loader)``, a common
pattern) hung until the collective timeout. Here each rank posts its totals to the job's
key-value store (the one ``init_process_group`` created, which needs no matching call on the other
ranks) and goes on; only rank 0, which prints the report, waits a few seconds for the others.
Under DDP the ranks end a pass within one step of each other, so the wait is normally short;
when a rank does not post in time rank 0 reports its own figures alone and says why once.
"""

from __future__ import annotations

import itertools
import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gpukit._util.warnings import warn_at_user_code

__all__ = ["EpochGather", "WAIT_S"]

#: how long rank 0 waits for the other ranks' totals of a pass
WAIT_S = 5.0
_loader_ids = itertools.count()  # loaders are built in the same order on every rank


def _default_store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class EpochGather:
    """Collects one loader's per-pass figures (a list of floats) from every rank on rank 0."""

    def __init__(self, rank: int, world_size: int, wait_s: float = WAIT_S) -> None:
        self.rank, self.world_size, self.wait_s = rank, world_size, wait_s
        self._prefix = f"gpukit/epoch-report/{next(_loader_ids)}"
        self._warned = False

    def gather(self, values: list[float], epoch: int) -> list[list[float]] | None:
        """Every rank's ``values`` in rank order on rank 0; ``[values]`` on the others.

        Returns:
            None on rank 0 when some rank did not post within ``wait_s`` (or there is no
            store): the caller reports this rank alone.
        """
        store = _default_store() if self.world_size > 1 else None
        if store is None:
            return [values] if self.world_size <= 1 or self.rank != 0 else None
        key = f"{self._prefix}/{epoch}"
        if self.rank != 0:
            store.set(f"{key}/{self.rank}", json.dumps(values))
            return [values]
        rows, missing = [values], []
        deadline = time.monotonic() + self.wait_s
        for rank in range(1, self.world_size):
            name = f"{key}/{rank}"
            try:
                store.wait([name], timedelta(seconds=max(0.05, deadline - time.monotonic())))
                rows.append(json.loads(store.get(name)))
                store.delete_key(name)
            except (RuntimeError, ValueError):  # DistStoreError (timeout) is a RuntimeError
                missing.append(rank)
        if not missing:
            return rows
        if not self._warned:
            self._warned = True
            warn_at_user_code(UserWarning(
                f"gpukit: the end-of-epoch data report of epoch {epoch} covers rank 0 only: "
                f"rank(s) {', '.join(map(str, missing))} did not finish the same pass over this "
                f"loader within {self.wait_s:g} s (a loader iterated on rank 0 alone, e.g. "
                "`if session.is_main: evaluate(loader)`, does this). Training is not affected."
            ))
        return None
