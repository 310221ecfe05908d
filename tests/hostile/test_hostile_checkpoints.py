"""Hostile checkpoints never run code, hang or leak a traceback (see corpus_checkpoints.py).

Each probe runs one reader in its own process, forked from one that imported torch and gpukit
once (`_zygote.py`: a fresh interpreter per probe cost 2-4 s of imports, the fork ~0.3 s;
test_probe_harness.py shows a fork is classified as a fresh interpreter is). The planted-pickle
probes also check that the canary file the pickle would create does not exist. Resume probes
that damage only the newest step must resume from the step before it, with a warning naming
the damaged one. The DDP/FSDP templates cost a 2-process launch each; `-m "not slow"` keeps
the one-process probes of each kind of fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _probe import SAFE, execute
from corpus_checkpoints import PROBES

# The DDP and FSDP templates are built once per process (corpus_checkpoints._template): under
# pytest -n this module's probes stay in one process, so each is built once, not once per process.
pytestmark = pytest.mark.one_worker

QUICK = {"metadata-pickle-single-inspect", "metadata-pickle-single-convert", "metadata-pickle-single-resume",
         "state-pickle-resume", "one-byte-inspect", "one-byte-load", "marker-fifo-resume",
         "step-symlink-loop-resume", "safetensors-overlap-inspect", "marker-world-size-text-resume",
         "safetensors-nested-header-inspect", "safetensors-duplicate-names-inspect", "convert-to-dev-null",
         "safetensors-million-tensors-inspect"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in sorted(PROBES)])
def test_hostile_checkpoint(name: str, tmp_path: Path) -> None:
    run = PROBES[name](tmp_path)
    result = execute(run, forked=True)
    assert result.outcome in SAFE, result.describe()
    if getattr(run.check, "falls_back", False):
        assert result.outcome == "correct", result.describe()
    if run.canary is not None:
        assert not run.canary.exists()
