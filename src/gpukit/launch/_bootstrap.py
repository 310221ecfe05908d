"""``python -m gpukit.launch._bootstrap (SCRIPT | -m MODULE) [ARGS...]``: a script worker.

Kept apart from :mod:`gpukit.launch._worker` so that running it with ``-m`` does not
import the module being run twice (the package imports ``_worker``, not this).
"""

from __future__ import annotations

from gpukit.launch._worker import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
