"""Hostile run records never hang ``gpukit report``, never exhaust memory and never show a traceback.

Every probe of corpus_records.py runs the real CLI in its own process on a record planted at
test time, forked from one that imported torch and gpukit once (``_zygote.py``); the outcome must
be a one-line error or a small report (see the corpus's checks).
The big records (hundreds of MB, a million lines, 100,000 rank files) are marked slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _probe import SAFE, execute
from corpus_records import BIG, PROBES


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n for n in sorted(PROBES)])
def test_hostile_record_is_handled_safely(name: str, tmp_path: Path) -> None:
    result = execute(PROBES[name](tmp_path), forked=True)
    assert result.outcome in SAFE, result.describe()
