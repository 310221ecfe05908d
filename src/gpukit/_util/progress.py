"""A live progress bar for rank 0 (``Session.progress``), built on rich."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(
    iterable: Iterable[T],
    *,
    total: int | None = None,
    description: str = "",
    enabled: bool = True,
    status: Callable[[], str] | None = None,
) -> Iterator[T]:
    """Yield from ``iterable`` while drawing a live bar (nothing is drawn when not ``enabled``).

    Args:
        iterable: what to iterate.
        total: number of items when ``len(iterable)`` does not work.
        description: text left of the bar.
        enabled: False on ranks other than 0, so only one bar is drawn.
        status: text right of the bar (e.g. samples/s), asked for at each redraw -- in the
            bar's refresh thread, so it costs the loop nothing.
    """
    if not enabled:
        yield from iterable
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

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
    if status is not None:

        class StatusColumn(ProgressColumn):
            def render(self, task: Any) -> Text:
                return Text(status())

        columns = (*columns, StatusColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in iterable:
            yield item
            bar.advance(task)
