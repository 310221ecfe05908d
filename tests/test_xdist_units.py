"""How ``make test`` (pytest -n) shares tests between its processes (tests/conftest.py's scheduler).

A real ``pytest -n 2`` on a generated tree with this suite's conftest.py: the SLURM tests form
one unit that starts first, though xdist would put the larger units before it; a module with a
module-scoped fixture, and a module marked ``one_worker``, each run in one process, so what
they build once is built once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

RECORD = '''
import os, time

def record(name):
    with open(os.environ["UNITS_LOG"], "a") as log:
        log.write(f"{os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()} {name}\\n")
'''

SLURM = '''
import pytest
from record import record

@pytest.mark.parametrize("i", range({n}))
def test_on_the_cluster(i):
    record("{name}")
'''

SHARED = '''
import pytest
from record import record

@pytest.fixture(scope="module")
def built():
    record("built")
    return 1

@pytest.mark.parametrize("i", range(12))
def test_uses_what_was_built(built, i):
    record("shared")
'''

MARKED = '''
import pytest
from record import record

pytestmark = pytest.mark.one_worker

@pytest.mark.parametrize("i", range(12))
def test_uses_a_module_cache(i):
    record("marked")
'''

SINGLES = '''
import pytest
from record import record

@pytest.mark.parametrize("i", range(20))
def test_alone(i):
    record("single")
'''


@pytest.mark.slow
def test_the_slurm_unit_starts_first_and_a_module_that_builds_once_stays_in_one_process(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "cluster").mkdir(parents=True)
    shutil.copy(CONFTEST, tests / "conftest.py")
    (tests / "record.py").write_text(RECORD)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the root: node ids start with tests/
    (tests / "cluster" / "test_slurm_cluster.py").write_text(SLURM.format(n=3, name="slurm"))
    (tests / "cluster" / "test_slurm_trials.py").write_text(SLURM.format(n=2, name="slurm"))
    (tests / "test_a_shared.py").write_text(SHARED)
    (tests / "test_b_marked.py").write_text(MARKED)
    (tests / "test_c_singles.py").write_text(SINGLES)
    log = tmp_path / "units.log"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env={**os.environ, "UNITS_LOG": str(log)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    by_name: dict[str, set[str]] = {}
    for worker, _, name in rows:
        by_name.setdefault(name, set()).add(worker)
    assert [name for *_, name in rows].count("built") == 1  # the module fixture: once
    for name in ("slurm", "shared", "marked"):
        assert len(by_name[name]) == 1, (name, rows)
    (slurm_worker,) = by_name["slurm"]
    first = min((float(t), name) for worker, t, name in rows if worker == slurm_worker)
    assert first[1] == "slurm", rows  # its process started with the SLURM unit


EXTENDED = '''
import pytest

@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.extended)])
def test_at_a_size(world):
    pass

@pytest.mark.extended
def test_another_way_in():
    pass
'''


@pytest.mark.parametrize("how", ["default", "option"])
def test_extended_variants_run_only_when_asked_for(tmp_path: Path, how: str) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(CONFTEST, tests / "conftest.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers\nmarkers =\n    extended: a variant\n    slow: slow\n")
    (tests / "test_sizes.py").write_text(EXTENDED)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN", "tests"]
    if how == "option":
        args.append("--extended")
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    if how == "default":
        assert "1 passed, 2 deselected" in summary, summary
    else:
        assert "3 passed" in summary and "deselected" not in summary, summary
