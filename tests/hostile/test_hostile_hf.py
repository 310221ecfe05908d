"""Every probe of corpus_hf.py ends in a clean error or a correct result (see _probe.py).

Each probe's reader runs in a process forked from one that imported torch and gpukit once
(``_zygote.py``; test_probe_harness.py shows a fork is classified as a fresh interpreter is).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _probe import SAFE, execute
from corpus_hf import PROBES


@pytest.mark.parametrize("name", sorted(PROBES))
def test_hostile_hf_input_is_handled(name: str, tmp_path: Path) -> None:
    result = execute(PROBES[name](tmp_path), forked=True)
    assert result.outcome in SAFE, result.describe()
