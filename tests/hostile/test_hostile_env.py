"""Hostile environments and CLI values never hang, exhaust memory or crash a check (corpus_env.py).

Each probe runs one reader (``gpukit doctor``, ``run``, ``select``, ``ls``, ``plan`` or the cluster
detector) in a fresh process with one hostile variable, file or option.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _probe import SAFE, execute
from corpus_env import PROBES


@pytest.mark.parametrize("name", sorted(PROBES))
def test_hostile_env(name: str, tmp_path: Path) -> None:
    result = execute(PROBES[name](tmp_path))
    assert result.outcome in SAFE, result.describe()
