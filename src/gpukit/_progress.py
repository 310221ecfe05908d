"""A live progress bar for rank 0 (``Session.progress``), built on rich."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(
    iterable: Iterable[T], *, total: int | None = None, description: str = "", enabled: bool = True
) -> Iterator[T]:
    """Yield from ``iterable`` while drawing a live bar (nothing is drawn when not ``enabled``).

    Args:
        iterable: what to iterate.
        total: number of items when ``len(iterable)`` does not work.
        description: text left of the bar.
        enabled: False on ranks other than 0, so only one bar is drawn.
    """
    if not enabled:
        yield from iterable
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in iterable:
            yield item
            bar.advance(task)
