"""`session.should_stop` on a GPU agrees without a sync: one call late, the same answer on every rank."""

from __future__ import annotations

from typing import Any

import torch

from gpukit.accelerators import SYNC_COUNTS, FakeCUDAAccelerator
from gpukit.session._runstate import RunState
from gpukit.worker import clear_stop_request, request_stop


class _Strategy:
    """Two ranks on a CUDA-like device; the other rank's flag is given by the test."""

    world_size = 2
    launched = True
    rank = 0
    root_device = torch.device("cpu")

    def __init__(self) -> None:
        self.accelerator = FakeCUDAAccelerator()
        self.other_rank_stops = False

    def all_reduce(self, value: torch.Tensor, op: str) -> torch.Tensor:
        assert op == "max"
        return torch.maximum(value, torch.tensor(float(self.other_rank_stops)))


def _runstate(strategy: Any) -> RunState:
    return RunState(strategy=strategy, steps=None, memory=None)  # type: ignore[arg-type]


def test_a_stop_on_another_rank_is_agreed_one_call_later_without_a_sync() -> None:
    strategy = _Strategy()
    state = _runstate(strategy)
    syncs = SYNC_COUNTS.syncs
    try:
        assert [state.should_stop() for _ in range(3)] == [False, False, False]
        strategy.other_rank_stops = True  # rank 1 got SIGTERM before this call
        assert state.should_stop() is False  # reduced now, read at the next call
        assert state.should_stop() is True
        assert SYNC_COUNTS.syncs == syncs  # the copy was done a call later: nothing waited
    finally:
        clear_stop_request()


def test_a_stop_on_this_rank_too() -> None:
    state = _runstate(_Strategy())
    try:
        assert state.should_stop() is False
        request_stop()
        assert [state.should_stop(), state.should_stop()] == [False, True]
    finally:
        clear_stop_request()
