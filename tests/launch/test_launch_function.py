"""launch_function: per-rank return values, failures naming the rank, clear errors for
functions that spawned workers cannot import."""

from __future__ import annotations

import signal
import sys
import types

import pytest
from launch_helpers import all_reduce_rank, fail_on_rank_one

from gpukit.errors import ConfigurationError, LaunchError
from gpukit.launch import WorkerFailedError, launch_function


@pytest.mark.slow
def test_returns_each_ranks_value_and_restores_signal_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    results = launch_function(all_reduce_rank, (10.0,), nproc=2, cpu=True, echo=None)
    assert results == [
        {"rank": 0.0, "world": 2.0, "sum": 30.0, "cpu": 1.0},
        {"rank": 1.0, "world": 2.0, "sum": 30.0, "cpu": 1.0},
    ]
    # The launch ran inside this (user) process: its handlers must be back.
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.slow
def test_worker_exception_names_rank_and_error():
    with pytest.raises(WorkerFailedError) as info:
        launch_function(fail_on_rank_one, nproc=2, cpu=True, grace_s=2, echo=None)
    err = info.value
    assert isinstance(err, LaunchError)
    assert err.root is not None and err.root.rank == 1
    assert "rank 1" in str(err) and "ValueError: bad batch on rank 1" in str(err)
    assert "launch_helpers.py" in str(err)  # where it was raised
    assert err.exit_code == 1


def test_unpicklable_functions_are_refused_before_anything_starts():
    with pytest.raises(ConfigurationError, match="lambda"):
        launch_function(lambda: 1, nproc=2, cpu=True, echo=None)

    def nested() -> int:
        return 1

    with pytest.raises(ConfigurationError, match="module level"):
        launch_function(nested, nproc=2, cpu=True, echo=None)
    with pytest.raises(ConfigurationError, match="args must be picklable"):
        launch_function(fail_on_rank_one, (lambda: 1,), nproc=2, cpu=True, echo=None)
    with pytest.raises(ConfigurationError, match="nproc"):
        launch_function(fail_on_rank_one, nproc=0, cpu=True, echo=None)


def test_function_from_an_interactive_main_is_refused_where_fork_is_not(monkeypatch):
    # where fork exists it is run in forked workers (tests/launch/test_notebook_launch.py)
    import multiprocessing

    fake_main = types.ModuleType("__main__")  # like a REPL or notebook: no __file__
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # as on Windows

    def typed_in_repl() -> None: ...

    typed_in_repl.__module__ = "__main__"
    with pytest.raises(ConfigurationError, match="defined interactively.*cannot fork. Put the function in a .py"):
        launch_function(typed_in_repl, nproc=1, cpu=True, echo=None)
