"""``Session.launch`` from one process: start the workers, build an equal Session in each."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukit.launch import LaunchSpec
    from gpukit.session._config import SessionConfig

__all__ = ["launch_workers"]


def launch_workers(
    session_class: type, config: SessionConfig, fn: Callable[..., Any], args: tuple, spec: LaunchSpec
) -> list[Any]:
    """Run ``fn(session, *args)`` in ``spec.nproc`` new processes, each with an equal session:
    ``session_class(**config.arguments())`` (``config`` is pickled to them, or inherited by a fork).

    Returns:
        ``fn``'s return values in rank order.
    """
    from gpukit.launch import launch_function

    return list(launch_function(_run_worker, (session_class, config, fn, args), spec))


def _run_worker(session_class: type, config: SessionConfig, fn: Callable[..., Any], args: tuple) -> Any:
    """Entry point of a process started by :meth:`Session.launch`."""
    session = session_class(**config.arguments())
    try:
        return fn(session, *args)
    finally:
        session.close()
