"""The ``__main__`` a spawned function worker imports first (see :mod:`gpukit.worker._spawn_import`).

Kept apart from it so that the package never imports this module: runpy runs it afresh as
``__mp_main__`` in the worker.
"""

from __future__ import annotations

from gpukit.worker._spawn_import import become_real_main

__all__: list[str] = []

if __name__ == "__mp_main__":
    become_real_main(globals())
