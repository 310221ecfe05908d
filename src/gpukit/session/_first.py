"""``session.main_process_first()``: rank 0 (or each node's first process) runs a block, then the others.

For what every rank needs but only one should make: a download, a tokenised cache, a dataset's
index. The first process runs the block while the others wait; then the others run it (and find
the files made). If the block raises on the first process, every other rank gets a
:class:`~gpukit.errors.DistributedError` naming the rank and its error -- not a wait until the
collective timeout, and not a run that goes on without the data.

Both sides meet in one all-gather of a status (``None``, or the first process's error): the first
process after its block, the others before theirs. The others therefore wait inside that collective,
for at most the session's collective timeout (``timeout_s``, default 30 minutes): a block that
takes longer needs a larger ``Session(timeout_s=...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpukit.errors import DistributedError

if TYPE_CHECKING:
    from gpukit.strategies import Strategy

__all__ = ["main_process_first"]


@contextlib.contextmanager
def main_process_first(strategy: Strategy, local: bool = False) -> Iterator[None]:
    """Run the block on rank 0 (``local=True``: on each node's local rank 0) first, then on the others.

    Raises:
        DistributedError: on the other ranks, when the block failed on a first process (the first
            process re-raises its own exception).
    """
    if strategy.world_size == 1:
        yield
        return
    first = (strategy.local_rank if local else strategy.rank) == 0
    if first:
        try:
            yield
        except BaseException as exc:
            with contextlib.suppress(Exception):  # a broken process group: the error is what matters
                strategy.all_gather_object(f"{type(exc).__name__}: {exc}"[:2000])
            raise
        strategy.all_gather_object(None)
        return
    statuses: list[Any] = strategy.all_gather_object(None)
    failed = [(rank, status) for rank, status in enumerate(statuses) if status is not None]
    if failed:
        rank, error = failed[0]
        who = "each node's first process" if local else "rank 0"
        raise DistributedError(
            f"The main_process_first block failed on rank {rank} ({error}); this rank (rank "
            f"{strategy.rank}) stops too instead of running it without what {who} was to prepare."
        )
    yield
