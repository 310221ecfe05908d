"""Two costs of torch elastic's dynamic rendezvous that gpukit's launches do not pay.

Measured on one launch of 2 CPU workers (0.83 s in all, cProfile, idle 2-core machine):

- 0.31 s: every rendezvous event names the method that recorded it with
  ``inspect.stack()`` -- twice per event, nine events per launch -- which reads the source
  file of every frame on the stack and scans ``sys.modules`` for each; the more modules a
  process has loaded (a notebook kernel), the slower. The same name comes from the frame
  itself (``sys._getframe``), without reading anything.
- 0.0-0.3 s (random): a node joining for the first time sleeps a random moment so that many
  nodes do not reach the store at once. On one machine there is one node and no crowd.

Both are replaced only for the duration of a gpukit launch, and only where torch still has
them under those names; with another torch the launch simply pays the costs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["cheaper_rendezvous"]


def _method_name(depth: int = 2) -> str:
    """What ``inspect.stack()[depth].function`` names, read from the frame."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a shallower stack
        return "no_method_name"


@contextmanager
def cheaper_rendezvous(single_machine: bool) -> Iterator[None]:
    """Within: rendezvous events named from frames; on one machine, no first-join skew."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as module
    except ImportError:
        yield
        return
    saved: dict[str, Any] = {}
    if callable(getattr(module, "get_method_name", None)):
        saved["get_method_name"] = module.get_method_name
        module.get_method_name = _method_name
    delay = getattr(module, "_delay", None)
    if single_machine and callable(delay):
        saved["_delay"] = delay

        def no_skew(seconds: Any) -> None:
            if not isinstance(seconds, tuple):  # a (low, high) range is the first-join skew
                delay(seconds)

        module._delay = no_skew
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
