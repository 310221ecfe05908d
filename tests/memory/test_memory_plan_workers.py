"""``fit(workers=N)`` / ``gpukit plan --fit --jobs N``: plans made in forked copies of the process
(gpukit/memory/_plan_workers.py) -- the same figures and ranking, errors raised as from a plain
loop, children that fail or crash planned again here, none left behind after an interrupt."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpukit.errors import ConfigurationError
from gpukit.memory import fit
from gpukit.memory._plan_workers import plan_all
from gpukit.memory._planner import MemoryEstimate

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import MODELS, Transformer  # noqa: E402


@pytest.fixture
def fork_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fork even if other tests of this process left threads behind (``can_fork`` refuses then:
    tested below on its own); these children only build a dataclass and write JSON."""
    import gpukit.memory._plan_workers as workers

    monkeypatch.setattr(workers, "can_fork", lambda: hasattr(os, "fork"))


def _estimate(key: int) -> MemoryEstimate:
    """A figure that says which process made it (``device`` holds the pid)."""
    return MemoryEstimate(key, 0, 0, 0, 0, 0, 0, "32-true", str(os.getpid()), notes=(f"key {key}",))


def test_children_plan_a_share_and_the_figures_come_back_whole(fork_here: None) -> None:
    done = plan_all(list(range(9)), _estimate, workers=3)
    assert list(done) == list(range(9))
    assert [e.peak_bytes for e in done.values()] == list(range(9))
    assert all(e.notes == (f"key {k}",) for k, e in done.items())
    pids = {e.device for e in done.values()}
    assert str(os.getpid()) in pids and len(pids) == 3  # this process and two children


def test_a_warm_process_forks_at_once_even_for_two_plans(fork_here: None) -> None:
    cold = plan_all([0, 1], _estimate, workers=2)  # the first plan loads what the children inherit
    assert {e.device for e in cold.values()} == {str(os.getpid())}
    warm = plan_all([0, 1], _estimate, workers=2, warm=True)
    assert [e.peak_bytes for e in warm.values()] == [0, 1]
    assert len({e.device for e in warm.values()}) == 2  # one here, one in a child


def test_an_error_is_raised_here_in_order_and_a_childs_failure_planned_again(fork_here: None) -> None:
    parent = os.getpid()

    def flaky_in_children(key: int) -> MemoryEstimate:
        if os.getpid() != parent and key % 2:
            raise RuntimeError("only in a child")
        return _estimate(key)

    done = plan_all(list(range(8)), flaky_in_children, workers=2)
    assert [e.peak_bytes for e in done.values()] == list(range(8))
    assert all(e.device == str(parent) for k, e in done.items() if k % 2)  # planned again here

    def broken(key: int) -> MemoryEstimate:
        if key in (5, 7):
            raise ValueError(f"plan {key} cannot run")
        return _estimate(key)

    with pytest.raises(ValueError, match="plan 5 cannot run"):  # the first failing key, as a loop would
        plan_all(list(range(8)), broken, workers=2)


def test_a_child_that_dies_is_planned_again_here(fork_here: None) -> None:
    parent = os.getpid()

    def dies_in_child(key: int) -> MemoryEstimate:
        if os.getpid() != parent:
            os._exit(3)
        return _estimate(key)

    done = plan_all(list(range(6)), dies_in_child, workers=2)
    assert [e.peak_bytes for e in done.values()] == list(range(6))
    assert {e.device for e in done.values()} == {str(parent)}


def test_no_fork_while_other_threads_run() -> None:
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        done = plan_all(list(range(6)), _estimate, workers=4)
    finally:
        stop.set()
        other.join()
    assert {e.device for e in done.values()} == {str(os.getpid())}


def test_an_interrupt_here_ends_the_children(fork_here: None) -> None:
    parent = os.getpid()
    read_end, write_end = os.pipe()

    def blocks_in_child(key: int) -> MemoryEstimate:
        if os.getpid() != parent:
            os.write(write_end, f"{os.getpid()}\n".encode())
            signal.pause()  # until killed
        if key == 0:
            return _estimate(key)  # the plan made before forking
        child = int(os.read(read_end, 64).split()[0])  # a child is running its share
        blocks_in_child.child = child  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan_all(list(range(5)), blocks_in_child, workers=2)
    os.close(read_end)
    os.close(write_end)
    child = blocks_in_child.child  # type: ignore[attr-defined]
    with pytest.raises(ChildProcessError):
        os.waitpid(child, os.WNOHANG)  # killed and reaped already: no zombie left
    assert not Path(f"/proc/{child}").exists()


@pytest.mark.parametrize("name", ["transformer", "cnn"])
def test_fit_in_workers_ranks_and_figures_as_in_one_process(name: str) -> None:
    torch.manual_seed(0)
    if name == "transformer":  # long enough to be planned from short copies
        model, x = Transformer(width=16, depth=6), torch.randint(0, 1000, (8, 8))
    else:
        factory, data = MODELS[name]
        model, x = factory(), data(16)
    kwargs = dict(memory="64MiB", device="cpu", precisions=["bf16-true"], checkpointing=["none", "selective"])
    alone, side_by_side = fit(model, x, **kwargs), fit(model, x, workers=2, **kwargs)
    assert alone.options and (alone.options, alone.closest, alone.cheaper_rejected, alone.notes) == \
        (side_by_side.options, side_by_side.closest, side_by_side.cheaper_rejected, side_by_side.notes)
    with pytest.raises(ConfigurationError, match="workers=0"):
        fit(model, x, workers=0, **kwargs)
