"""A steady-state step issues no host synchronisation and no device event (docs/data.md, DESIGN.md):
counted with the CUDA-like fake accelerator on the CPU, and on a GPU under torch's sync debug mode."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpukit
from gpukit.accelerators import SYNC_COUNTS, FakeCUDAAccelerator
from gpukit.data import StepTiming, StepTimings
from gpukit.data._pinned import PinnedMover
from gpukit.errors import ConfigurationError
from gpukit.report import read_record

STEPS = 80  # 640 samples in batches of 8


def _train_one_epoch(session: gpukit.Session, loader, log: bool) -> list[tuple[int, int, int]]:
    """One epoch of a real loop; the (step, syncs, events) counts seen as each step completed."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seen: list[tuple[int, int, int]] = []
    listener = lambda r: seen.append((r.step, SYNC_COUNTS.syncs, SYNC_COUNTS.events))  # noqa: E731
    session.timings.add_listener(listener)
    for x, y in session.progress(loader):
        with session.accumulate(model):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
        session.step(optimizer, clip_grad_norm=1.0)
        if log:
            session.log(loss=loss.detach(), first=x[0, 0])
    session.timings.remove_listener(listener)
    return seen


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(STEPS * 8, 8, generator=g), torch.randint(0, 2, (STEPS * 8,), generator=g))


def test_a_steady_step_issues_no_sync_and_no_event() -> None:
    # (no record: its writer thread's reads, one event per flush, would land between steps here;
    # tests/monitor/test_lazy_read.py counts them)
    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    loader = session.setup_dataloader(_data(), batch_size=8, num_workers=0)
    assert loader.pinned_pool  # batches are pinned through the pool (a device that gains from it, no workers)
    seen = _train_one_epoch(session, loader, log=True)
    assert [step for step, _, _ in seen] == list(range(STEPS))
    timings = session.timings
    sampled = {i for i in range(STEPS) if i < timings.sample_first or i % timings.sample_every == 0}
    assert sampled == {0, 1, 2, 16, 32, 48, 64}
    before = (0, *seen[0][1:])
    per_step = {}
    for (step, syncs, events), (_, syncs_before, events_before) in zip(seen, [before, *seen]):
        per_step[step] = (syncs - syncs_before, events - events_before)
    # the first step's counts are measured from its own completion: compare the others
    for step in range(1, STEPS):
        syncs, events = per_step[step]
        assert syncs == 0, f"step {step} synchronised {syncs} time(s)"
        if step in sampled:  # two events around the copy, the pool's fence query, the step's query
            assert events == 4, f"sampled step {step}: {events} event operations"
        else:
            assert events == 0, f"steady step {step} issued {events} event operation(s)"
    session.close()


def test_the_epoch_line_says_the_copy_was_sampled_and_its_error() -> None:
    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    loader = session.setup_dataloader(_data(), batch_size=8, num_workers=0)
    _train_one_epoch(session, loader, log=False)
    summary = session.throughput()
    assert summary.steps == STEPS and summary.h2d_sampled == 7 and summary.h2d_share is not None
    assert summary.h2d_share_err is not None and summary.h2d_share_err >= 0
    line = session.timings.epoch_reports[-1].line
    assert re.search(r"copy \d+% \+-\d+% \(sampled 7 of 80 steps\)", line), line


def test_every_step_timed_when_asked() -> None:
    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    session.timings.sample_every = 1
    records: list[StepTiming] = []
    session.timings.add_listener(records.append)
    for _ in session.setup_dataloader(_data(), batch_size=64, num_workers=0):
        pass
    assert len(records) == 10 and all(r.h2d_s is not None and r.h2d_s > 0 for r in records)
    summary = session.throughput()
    assert summary.h2d_sampled == 10 and summary.h2d_share_err == 0.0
    assert "(sampled" not in session.timings.epoch_reports[-1].line  # every step measured: no error to give


def test_exact_timing_synchronises_around_sampled_steps_only() -> None:
    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    session.timings.exact = True
    before = SYNC_COUNTS.syncs
    records: list[StepTiming] = []
    session.timings.add_listener(records.append)
    for _ in session.setup_dataloader(_data(), batch_size=8, num_workers=0):
        pass
    # at the 13 boundaries that open or close a sampled step (0-3, 16-17, 32-33, 48-49, 64-65, 80: the
    # request that ends the pass), and after each of the 7 sampled copies; none around the other steps
    assert SYNC_COUNTS.syncs - before == 13 + 7
    assert all(r.exact for r in records)
    assert [r.step for r in records if r.h2d_s is not None] == [0, 1, 2, 16, 32, 48, 64]


def test_sampling_settings_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="sample_every=0"):
        StepTimings(sample_every=0)
    with pytest.raises(ConfigurationError, match="sample_first=-1"):
        StepTimings(sample_first=-1)


def test_batches_through_the_pool_are_the_datasets_and_buffers_are_reused() -> None:
    session = gpukit.Session(accelerator=FakeCUDAAccelerator(), devices=1, precision="32-true", verbose=False)
    data = _data()
    loader = session.setup_dataloader(data, batch_size=8, num_workers=0, shuffle=False)
    kept = [(x, y) for x, y in loader]  # held past later batches: a reused buffer must not show through
    assert torch.equal(torch.cat([x for x, _ in kept]), data.tensors[0])
    assert torch.equal(torch.cat([y for _, y in kept]), data.tensors[1])
    mover = loader._move
    assert isinstance(mover, PinnedMover)
    pool = mover.pool
    assert pool.reused > 0 and pool.outside == 0
    # buffers in flight between two fences: at most the steps from one sampled step to the next, x2 tensors
    assert pool.allocated <= 2 * (session.timings.sample_every + 1)
    assert not loader.loader.pin_memory  # the DataLoader does not pin again


@pytest.mark.requires_gpu
def test_a_session_epoch_runs_under_cuda_sync_debug_mode_error(tmp_path: Path) -> None:
    session = gpukit.Session(devices=1, precision="bf16-mixed", verbose=False, record=tmp_path / "rec")
    loader = session.setup_dataloader(_data(), batch_size=8, num_workers=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    for x, y in loader:  # a first epoch: set-up costs (allocations, lazy inits) are not steady state
        session.backward(F.cross_entropy(model(x), y))
        session.step(optimizer)
    before = (SYNC_COUNTS.syncs, SYNC_COUNTS.events)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in session.progress(loader):
            with session.autocast():
                loss = F.cross_entropy(model(x), y)
            session.backward(loss)
            session.step(optimizer, clip_grad_norm=1.0)
            session.log(loss=loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert SYNC_COUNTS.syncs == before[0]
    assert SYNC_COUNTS.events - before[1] <= 4 * 7 + 8  # sampled steps, and the record's reads
    session.close()
    steps = read_record(tmp_path / "rec").ranks[0].steps
    assert all(isinstance(s["scalars"]["loss"], float) for s in steps[STEPS:])


def test_a_sampled_copys_events_are_recorded_with_the_loaders_device_current() -> None:
    """A copy runs on the current stream of its target device; its timing events (and the pinned pool's fence)
    must be recorded there too. With another GPU current (a loader for cuda:1 while cuda:0 is current), an event on
    cuda:0's stream passed before the copy ran, and a fenced pinned buffer could be reused while still read."""
    current: list[torch.device | None] = [None]
    recorded: list[torch.device | None] = []

    class _TwoDevices(FakeCUDAAccelerator):
        def device_scope(self, device: torch.device) -> Any:
            @contextlib.contextmanager
            def scope() -> Iterator[None]:
                before, current[0] = current[0], device
                try:
                    yield
                finally:
                    current[0] = before
            return scope()

        def timing_event(self) -> Any:
            recorded.append(current[0])
            return super().timing_event()

    target = torch.device("cpu", 1)  # stands for cuda:1, the fake's copies run on the CPU
    timings = StepTimings(_TwoDevices(), sample_every=1, sample_first=1)
    batches = [torch.ones(2, 3) for _ in range(4)]
    out = list(timings.iterate(batches, epoch=0, move=lambda b: b.clone(), device=target))
    assert len(out) == 4 and recorded and all(d == target for d in recorded), recorded
