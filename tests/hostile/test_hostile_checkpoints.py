"""Hostile checkpoints never run code, hang or leak a traceback (see corpus_checkpoints.py).

Each probe runs one reader in a fresh process; the planted-pickle probes also check that the
canary file the pickle would create does not exist. Resume probes that damage only the newest
step must resume from the step before it, with a warning naming the damaged one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _probe import SAFE, execute
from corpus_checkpoints import PROBES


@pytest.mark.parametrize("name", sorted(PROBES))
def test_hostile_checkpoint(name: str, tmp_path: Path) -> None:
    run = PROBES[name](tmp_path)
    result = execute(run)
    assert result.outcome in SAFE, result.describe()
    if getattr(run.check, "falls_back", False):
        assert result.outcome == "correct", result.describe()
    if run.canary is not None:
        assert not run.canary.exists()
