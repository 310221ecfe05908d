"""bench/ scripts run as `python bench/x.py`, which puts bench/ first on sys.path: a script named like a standard
module (bench/queue.py) hides it from every other script there -- `import torch` failed with "cannot import name
'Queue' from 'queue'" in bench/_planner_fsdp.py."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_script_hides_a_standard_module() -> None:
    names = {p.stem for p in BENCH.glob("*.py")} | {p.name for p in BENCH.iterdir() if p.is_dir()}
    hidden = sorted(names & set(sys.stdlib_module_names))
    assert not hidden, f"bench/ holds {hidden}, which hide the standard modules of the same names: rename them"
