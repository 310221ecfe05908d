"""Logged device values are read back without a wait: the record writes their lines once the
device passed the copy's event (a flush later), and waits only at close."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from gpukit.accelerators import SYNC_COUNTS
from gpukit.data import StepTiming
from gpukit.monitor import Recorder
from gpukit.monitor._lazy_read import LazyRead

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slow_device import SlowDevice  # noqa: E402


def test_a_read_fills_in_once_the_device_passed_its_event_never_waiting() -> None:
    device = SlowDevice()
    rows: dict[str, Any] = {"loss": torch.tensor(1.5), "acc": torch.tensor([0.25]), "n": 3}
    syncs = SYNC_COUNTS.syncs
    read = LazyRead([(rows, "loss"), (rows, "acc"), (rows, "n")], device)
    assert not read.done() and torch.is_tensor(rows["loss"])  # the copy is still on its way
    assert rows["n"] == 3 and len(device.events) == 1  # one copy and one event for the device's values
    device.events[0].passed = True
    assert read.done() and rows == {"loss": 1.5, "acc": 0.25, "n": 3}
    assert SYNC_COUNTS.syncs == syncs


def test_host_values_are_read_at_once() -> None:
    rows = {"loss": torch.tensor(2.0)}
    assert LazyRead([(rows, "loss")]).done() and rows == {"loss": 2.0}


def _timing(step: int) -> StepTiming:
    return StepTiming(step=step, epoch=0, rank=0, samples=8, step_time_s=0.01, data_wait_s=0.001, h2d_s=None,
                      compute_s=0.009, exact=True)


def _steps(path: Path) -> list[dict[str, Any]]:
    return [line for line in map(json.loads, path.read_text().splitlines()) if line["type"] == "step"]


def test_the_record_writes_logged_device_values_a_flush_later(tmp_path: Path) -> None:
    device = SlowDevice()
    recorder = Recorder(tmp_path, accelerator=device, sample_interval_s=3600.0, tensorboard=None)
    for step in range(3):
        recorder.log(loss=torch.tensor(float(step)))
        recorder.on_step(_timing(step))
    recorder.flush()
    assert _steps(recorder.path) == []  # their values are still being copied: nothing waited for them
    recorder.log(loss=torch.tensor(3.0))
    recorder.on_step(_timing(3))
    recorder.flush()
    assert _steps(recorder.path) == []  # held behind the read in flight, in order
    device.events[0].passed = True
    recorder.flush()
    assert [s["scalars"]["loss"] for s in _steps(recorder.path)] == [0.0, 1.0, 2.0]
    syncs = SYNC_COUNTS.syncs
    recorder.close()  # waits for the last read (one sync, at close)
    assert [s["scalars"]["loss"] for s in _steps(recorder.path)] == [0.0, 1.0, 2.0, 3.0]
    assert SYNC_COUNTS.syncs == syncs + 1
