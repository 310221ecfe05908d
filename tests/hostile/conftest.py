"""Make ``_probe`` and the ``corpus_*`` modules importable from the hostile tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
