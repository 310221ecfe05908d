"""``python -m gpukit.worker._bootstrap (SCRIPT | -m MODULE) [ARGS...]``: a script worker.

Kept apart from :mod:`gpukit.worker._entry` so that running it with ``-m`` does not
import the module being run twice (the package imports ``_entry``, not this).
"""

from __future__ import annotations

from gpukit.worker._entry import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
