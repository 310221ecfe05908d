"""Which gpukit loader is handing out batches, and ranks whose loaders differ in length.

:class:`LoaderTracker` listens to every loader ``Session.setup_dataloader`` builds. It tells the
training step how many batches the pass has left (an accumulation window ends with the pass) and
``gather_for_metrics`` how many samples of the batch in hand are padding repeats.

It also refuses the classic hang before it happens: with ``even_batches=False`` ranks may get
different numbers of batches, and under several processes the rank that runs out first leaves the
gradient all-reduce while the others wait in it until the collective timeout. Every rank computes
every rank's batch count from the same formula, so they all raise the same error at the start of
the pass -- unless the pass runs inside ``session.join(model)`` (:func:`join_uneven`), where DDP's
join lets the finished ranks shadow the others' all-reduces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpukit.data import LoaderListener
from gpukit.errors import ConfigurationError

if TYPE_CHECKING:
    from torch import nn

    from gpukit.data import DeviceLoader
    from gpukit.strategies import Strategy

__all__ = ["LoaderTracker", "join_uneven"]


class LoaderTracker(LoaderListener):
    """The gpukit loader whose batch is in hand (see the module docstring).

    Args:
        world_size: processes in the job (uneven batch counts matter only above 1).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: loaders ``session.setup_dataloader`` built (sharded by the data-parallel coordinates of then)
        self.made = 0
        self.current: DeviceLoader | None = None
        #: inside ``session.join``: ranks may run different numbers of batches
        self.joined = False
        #: told when a pass ends, with whether the loader has a length (the Session's steps)
        self.on_pass_end: Any = None
        #: told of each batch handed out while set (the Session's FLOP count; ``None`` once done)
        self.on_batch: Any = None

    # -- LoaderListener ---------------------------------------------------------------------
    def pass_started(self, loader: DeviceLoader) -> None:
        counts = loader.batches_per_rank()
        if self.world_size > 1 and counts and len(set(counts)) > 1 and not self.joined:
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            raise ConfigurationError(
                f"This loader gives the ranks different numbers of batches ({per_rank}; "
                f"even_batches=False, {len(loader.dataset)} samples, batch_size {loader.batch_size}). "
                "The rank that runs out first would leave the gradient all-reduce while the others wait in "
                "it -- a hang until the collective timeout. Iterate it inside `with session.join(model):` "
                "(DDP: finished ranks shadow the others' all-reduces), or build it with even_batches='pad' "
                "(a few samples repeated; session.gather_for_metrics drops them) or 'drop'."
            )

    def batch(self, loader: DeviceLoader) -> None:
        self.current = loader
        if self.on_batch is not None:
            self.on_batch()

    def pass_ended(self, loader: DeviceLoader) -> None:
        if self.current is loader:
            self.current = None
        if self.on_pass_end is not None:
            self.on_pass_end(_has_length(loader))

    # -- questions ----------------------------------------------------------------------------
    def batches_left(self) -> int | None:
        """Batches of the current pass from the one in hand on (it included); ``None`` when no gpukit
        loader's pass is under way or it has no length."""
        loader = self.current
        if loader is None or not loader.in_pass or not _has_length(loader):
            return None
        return len(loader) - loader.batches_consumed + 1

    def samples_in_batch(self) -> tuple[int, int] | None:
        """``(samples, real)`` of the batch in hand (real: not padding repeats); ``None``: not known."""
        loader = self.current
        if loader is None or not loader.in_pass:
            return None
        return loader.samples_in_batch()


def _has_length(loader: DeviceLoader) -> bool:
    try:
        len(loader)
    except TypeError:  # an IterableDataset without __len__
        return False
    return True


@contextlib.contextmanager
def join_uneven(tracker: LoaderTracker, strategy: Strategy, model: nn.Module) -> Iterator[None]:
    """``session.join(model)``: let ranks run different numbers of batches (see the module docstring).

    Under DDP this is torch's ``Join``: a rank whose loader ran out keeps answering the others'
    gradient all-reduces (with zeros) until every rank has finished. Other collectives of the loop
    (``session.all_reduce``, ``should_stop``, ``gather_for_metrics``) have no such stand-in.

    Raises:
        ConfigurationError: several processes under a strategy torch's ``Join`` cannot serve (FSDP).
    """
    from torch.nn.parallel import DistributedDataParallel

    if strategy.data_parallel_size == 1:
        joined: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    elif isinstance(model, DistributedDataParallel):
        from torch.distributed.algorithms import Join

        joined = Join([model])
    else:
        raise ConfigurationError(
            f"session.join(model) lets ranks run different numbers of batches under DDP only; this is "
            f"strategy {strategy.name!r} with a {type(model).__name__}. Build the loader with "
            "even_batches='pad' (a few samples repeated; gather_for_metrics drops them) or 'drop' so "
            "every rank runs the same number of batches."
        )
    tracker.joined = True
    try:
        with joined:
            yield
    finally:
        tracker.joined = False
